"""The production Prefect stack on one machine, as Prefect documents it: a server on
PostgreSQL, a process work pool, a worker, and the deployments of prefect.yaml.

`goodput server` runs it in the foreground (Ctrl-C stops it); the tests start the same
stack. Everything it keeps lives under one directory (default `.goodput/server`): the
database cluster, the Prefect home, the logs and two secrets it generates on first start
and reuses after:

    postgres-password   the database user's password (the server's connection URL)
    api-auth-string     `goodput:<token>`: Prefect's API auth (PREFECT_SERVER_API_AUTH_STRING)

A server that can start training on a GPU cluster lets no one in unasked: the API asks for
the auth string (clients set PREFECT_API_AUTH_STRING; the UI prompts for it), the server and
the database listen on 127.0.0.1 unless told otherwise, and the database wants its password.

    with PrefectStack(".goodput/server") as stack:
        env = {**os.environ, **stack.client_env()}   # PREFECT_API_URL, PREFECT_API_AUTH_STRING
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from infra.launchers import free_port

if TYPE_CHECKING:  # imported where used: every goodput command reads this module's settings
    import httpx

REPO = Path(__file__).resolve().parents[1]
POOL = "goodput"  # the work pool prefect.yaml's deployments name
# Where a server keeps concurrency leases (a run's training slot): on disk, under its
# PREFECT_HOME. Prefect's default keeps them in memory, so a restarted server forgets them:
# their holders' renewals fail, and the slots they held stay taken.
LEASES_ON_DISK = "prefect.server.concurrency.lease_storage.filesystem"
_PG_TOOLS = ("initdb", "pg_ctl", "psql")
# The worker's flow runs (which inherit its environment) retry an API call that finds no
# server 7 times, 2, 4, ... 128 s apart: a server restart of up to about 4 minutes leaves
# training flows running. Prefect's default, 5, gives up after about a minute, and a restart
# on a busy machine (migrations checked, services started) can take longer than that.
OUTAGE_RETRIES = 7
# In the environment of the stack's workers, so of every process they start: the stack's
# directory. A stopping stack finds its flow runs by it, those of a worker it replaced too.
STACK_MARK = "GOODPUT_STACK_DIR"
# The hash of the prefect.yaml the stack last deployed, kept in its directory: a restart
# deploys again only when prefect.yaml changed (see PrefectStack.deploy).
DEPLOYED_HASH_FILE = "prefect-yaml.sha256"


# What the deployments are made of besides prefect.yaml: the flows' parameter forms (their
# signatures, RunConfig's fields and defaults). A pull that changes a form redeploys too.
FORM_SOURCES = ("flows/*.py", "core/config.py")


def prefect_yaml_hash(prefect_yaml: Path) -> str:
    """prefect.yaml's hash, with the sources of the forms its deployments show."""
    digest = hashlib.sha256(prefect_yaml.read_bytes())
    for pattern in FORM_SOURCES:
        for path in sorted(prefect_yaml.parent.glob(pattern)):
            digest.update(f"\0{path.relative_to(prefect_yaml.parent)}\0".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def declared_deployments(prefect_yaml: Path) -> list[str]:
    """The names of prefect.yaml's deployments."""
    import yaml

    try:
        return [d["name"] for d in yaml.safe_load(prefect_yaml.read_text())["deployments"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as e:
        raise RuntimeError(f"{prefect_yaml}: cannot read its deployments' names ({e}); it needs "
                           "a `deployments:` list whose entries each have a `name`") from e


def deployments_to_deploy(prefect_yaml: Path, deployed_hash: str | None,
                          on_server: set[str]) -> list[str]:
    """Which of prefect.yaml's deployments a stack starting up deploys: all of them when
    prefect.yaml is not the one it last deployed (`deployed_hash`, None when it never did),
    else only those the server does not have (`on_server`: its deployment names).

    `prefect deploy` replaces a deployment whole, so deploying on every start reset what
    users changed in the UI since: a schedule switched on, job variables, the work pool."""
    declared = declared_deployments(prefect_yaml)
    if deployed_hash != prefect_yaml_hash(prefect_yaml):
        return declared
    return [name for name in declared if name not in on_server]


def _postgres_bin(tool: str) -> str:
    """A PostgreSQL program: on PATH, else Debian's /usr/lib/postgresql/<version>/bin."""
    found = shutil.which(tool)
    if found:
        return found
    for version_dir in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (version_dir / tool).is_file():
            return str(version_dir / tool)
    raise FileNotFoundError(f"PostgreSQL's {tool} not found: install PostgreSQL "
                            "(Debian: apt-get install postgresql)")


def missing_postgres() -> list[str]:
    missing = []
    for tool in _PG_TOOLS:
        try:
            _postgres_bin(tool)
        except FileNotFoundError:
            missing.append(tool)
    return missing


def _secret(path: Path, make) -> str:
    """The secret kept at `path` (0600), made on first use."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make())
    return path.read_text().strip()


class Postgres:
    """A PostgreSQL cluster in `directory`, on 127.0.0.1:`port`, one password-protected user.

    PostgreSQL refuses to run as root: as root, its files belong to the `postgres` user and
    its programs run as that user (runuser)."""

    USER = "goodput"

    def __init__(self, directory: Path, port: int, password: str):
        self.directory, self.port, self.password = directory, port, password
        self.data = directory / "data"
        self.log = directory / "postgres.log"

    @property
    def url(self) -> str:
        return (f"postgresql+asyncpg://{self.USER}:{self.password}@127.0.0.1:{self.port}/prefect")

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            owner = pwd.getpwnam("postgres")
            os.chown(path, owner.pw_uid, owner.pw_gid)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        if os.geteuid() == 0:
            closed = [p for p in self.directory.parents if not p.stat().st_mode & 0o001]
            if closed:
                raise PermissionError(
                    f"PostgreSQL runs as the user 'postgres', which cannot reach "
                    f"{self.directory}: {closed[0]} is closed to other users. Keep the stack "
                    f"elsewhere (goodput server --dir), or open that directory to others "
                    f"(chmod o+x {closed[0]})")
        self._chown(self.directory)
        if not (self.data / "PG_VERSION").exists():
            password_file = self.directory / ".initdb-password"
            password_file.write_text(self.password)
            self._chown(password_file)
            try:
                proc = subprocess.run(self._as_owner([
                    _postgres_bin("initdb"), "-D", str(self.data), "-U", self.USER,
                    "--auth=scram-sha-256", f"--pwfile={password_file}", "--locale=C.UTF-8",
                    "--encoding=UTF8"]), capture_output=True, text=True)
            finally:
                password_file.unlink()
            if proc.returncode != 0:
                raise RuntimeError(f"initdb failed: {proc.stderr.strip()}")
        options = (f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 "
                   "-c max_connections=200")
        proc = subprocess.run(self._as_owner([
            _postgres_bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
            "-w", "-t", "60", "start"]), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"PostgreSQL did not start: {proc.stderr.strip()}\n"
                               f"{self.log.read_text()[-2000:] if self.log.exists() else ''}")
        if "prefect" not in self.sql("SELECT datname FROM pg_database").split():
            self.sql("CREATE DATABASE prefect")

    def sql(self, query: str, database: str = "postgres") -> str:
        """One statement through psql; its rows, `|`-separated."""
        proc = subprocess.run(
            [_postgres_bin("psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.USER,
             "-d", database, "-A", "-t", "-c", query],
            env={**os.environ, "PGPASSWORD": self.password}, capture_output=True, text=True,
            timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"psql: {proc.stderr.strip()}")
        return proc.stdout

    def running(self) -> bool:
        """Whether the postmaster its pid file names is alive (what `pg_ctl status` reads,
        without a runuser session every few seconds)."""
        import psutil

        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return False
        return psutil.pid_exists(pid)  # (another user's process counts as alive)

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            subprocess.run(self._as_owner([_postgres_bin("pg_ctl"), "-D", str(self.data),
                                           "-m", "fast", "-w", "stop"]), capture_output=True)


class PrefectStack:
    """PostgreSQL, `prefect server start` on it, the work pool, the deployments, a worker."""

    def __init__(self, directory: str | os.PathLike = ".goodput/server", host: str = "127.0.0.1",
                 port: int = 4200, pool: str = POOL, worker: bool = True,
                 repo: str | os.PathLike = REPO, pg_port: int | None = None,
                 extra_env: dict[str, str] | None = None):
        self.directory = Path(directory).absolute()
        self.host, self.port, self.pool, self.with_worker = host, port, pool, worker
        self.repo = Path(repo).absolute()
        self.extra_env = extra_env or {}
        self.directory.mkdir(parents=True, exist_ok=True)
        # Its secrets are files of mode 0600; the postgres user must be able to pass through.
        os.chmod(self.directory, 0o711)
        self.auth_string = _secret(self.directory / "api-auth-string",
                                   lambda: f"goodput:{secrets.token_urlsafe(24)}")
        self.postgres = Postgres(self.directory / "postgres", pg_port or free_port(),
                                 _secret(self.directory / "postgres-password",
                                         lambda: secrets.token_hex(16)))
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None

    # -- addresses and environments -----------------------------------------------------------

    @property
    def url(self) -> str:
        shown = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{shown}:{self.port}"

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def client(self) -> StackClient:
        return StackClient(self.api_url, self.auth_string)

    def task_runs_since(self, since: float) -> tuple[int, dict[str, int]]:
        """Task runs of flow runs started after `since` (Unix time): how many logged that
        they finished, and how many the database holds per state (those standing for a
        subflow left out: they log no "Finished in state")."""
        after = f"to_timestamp({since})"
        logged = int(self.postgres.sql(
            "SELECT count(DISTINCT task_run_id) FROM log WHERE task_run_id IS NOT NULL "
            f"AND message LIKE 'Finished in state%' AND timestamp > {after}", "prefect"))
        states = {state: int(n) for state, n in (line.split("|") for line in self.postgres.sql(
            f"SELECT state_type, count(*) FROM task_run WHERE created > {after} AND id NOT IN "
            "(SELECT parent_task_run_id FROM flow_run WHERE parent_task_run_id IS NOT NULL) "
            "GROUP BY state_type", "prefect").split())}
        return logged, states

    def client_env(self) -> dict[str, str]:
        """What a client (a CLI, a flow run, a worker) needs to reach the API."""
        return {"PREFECT_API_URL": self.api_url, "PREFECT_API_AUTH_STRING": self.auth_string}

    def _env(self, **extra: str) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items()
               if not key.startswith(("PREFECT_API_", "PREFECT_SERVER_API_"))}
        return {**env, "PREFECT_HOME": str(self.directory / "prefect"),
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **self.client_env(),
                **self.extra_env, **extra}

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    # -- start and stop -----------------------------------------------------------------------

    def __enter__(self) -> PrefectStack:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 180.0, say: Callable[[str], None] | None = None) -> None:
        """Start it all; `say` (default: stderr) tells what the deploy step did."""
        self.postgres.start()
        self.start_server(timeout_s)
        self.prefect("work-pool", "inspect", self.pool, check=False) \
            or self.prefect("work-pool", "create", self.pool, "--type", "process")
        self.deploy(say or _say_on_stderr)
        if self.with_worker:
            self.start_worker()

    def deploy(self, say: Callable[[str], None]) -> list[str]:
        """Deploy what of prefect.yaml is needed (deployments_to_deploy): everything when
        prefect.yaml changed since the last deploy, else only deployments the server lacks;
        the others stay as the UI left them. The names deployed."""
        prefect_yaml = self.repo / "prefect.yaml"
        hash_file = self.directory / DEPLOYED_HASH_FILE
        deployed_hash = hash_file.read_text().strip() if hash_file.exists() else None
        on_server = {d["name"] for d in self.client().post("/deployments/filter", {
            "deployments": {"name": {"any_": declared_deployments(prefect_yaml)}}}).json()}
        names = deployments_to_deploy(prefect_yaml, deployed_hash, on_server)
        if not names:
            say(f"deployments left as they are on the server (prefect.yaml unchanged since "
                f"this stack deployed it; changes made in the UI are kept). To deploy "
                f"prefect.yaml again on purpose, from {self.repo}: PREFECT_API_URL={self.api_url} "
                f"PREFECT_API_AUTH_STRING=\"$(cat {self.directory / 'api-auth-string'})\" "
                "prefect --no-prompt deploy --all")
            return []
        new_hash = prefect_yaml_hash(prefect_yaml)  # what is deployed, read before deploying
        if deployed_hash == new_hash:
            by_name = [arg for name in names for arg in ("--name", name)]
            self.prefect("--no-prompt", "deploy", *by_name, cwd=self.repo, timeout=600)
        else:
            self.prefect("--no-prompt", "deploy", "--all", cwd=self.repo, timeout=600)
        hash_file.write_text(new_hash + "\n")
        say(f"deployed {', '.join(names)} from {prefect_yaml}")
        return names

    def start_server(self, timeout_s: float = 180.0) -> None:
        self.server = self._spawn("server", [_prefect(), "server", "start", "--host", self.host,
                                             "--port", str(self.port)],
                                  PREFECT_API_DATABASE_CONNECTION_URL=self.postgres.url,
                                  PREFECT_SERVER_API_AUTH_STRING=self.auth_string,
                                  PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE=LEASES_ON_DISK)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.server.poll() is not None:
                raise RuntimeError(f"prefect server exited ({self.server.returncode}): "
                                   f"{self.log('server').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"prefect server not healthy after {timeout_s:.0f}s: "
                                   f"{self.log('server').read_text()[-3000:]}")
            time.sleep(0.5)

    def keep_up(self) -> list[tuple[str, Path]]:
        """Start again what of the stack exited (PostgreSQL, the server, the worker): what
        was, with its log. PostgreSQL back, the server is started again too: its
        connections to the database died with it, and its health check, which reads none,
        kept answering while every other request failed (500)."""
        restarted = []
        if not self.postgres.running():
            restarted.append(("PostgreSQL", self.postgres.log))
            self.postgres.start()
            _end(self.server, signal.SIGTERM)
        if self.server.poll() is not None:
            restarted.append(("the Prefect server", self.log("server")))
            self.start_server()
        if self.with_worker and self.worker.poll() is not None:
            restarted.append(("the worker", self.log("worker")))
            self.start_worker()
        return restarted

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.api_url}/health", timeout=2,
                             auth=tuple(self.auth_string.split(":", 1))).status_code == 200
        except httpx.HTTPError:
            return False

    def start_worker(self) -> None:
        """A process worker on the pool; its flow runs start in the repository (GOODPUT_REPO,
        read by prefect.yaml's pull step: flows.deployments.enter_repository) with this
        stack's client environment."""
        self.worker = self._spawn("worker", [_prefect(), "worker", "start", "--pool", self.pool,
                                             "--type", "process"],
                                  GOODPUT_REPO=str(self.repo),
                                  PREFECT_CLIENT_MAX_RETRIES=str(OUTAGE_RETRIES),
                                  **{STACK_MARK: str(self.directory)})

    def kill_server(self) -> None:
        """The server dies at once (SIGKILL), as in a crash; PostgreSQL keeps its data."""
        _end(self.server, signal.SIGKILL)

    def kill_worker(self) -> None:
        _end(self.worker, signal.SIGKILL, group=False)  # only the worker: its flow runs go on

    def cancel_flow_runs(self, timeout_s: float = 120,
                         say: Callable[[str], None] = lambda message: None) -> list[str]:
        """Cancel the flow runs this stack's workers run, as the UI's Cancel does (training
        saves an emergency checkpoint, the attempt ends cancelled), and wait up to `timeout_s`
        for them to end. Their ids. Those of a worker the stack replaced too: they outlive
        it, and no worker stops them, so they get the SIGTERM a worker's cancel sends, then
        their Cancelled state. Runs of other workers on the same pool (other machines, or
        started by hand) are theirs: they go on."""
        if not (self.with_worker and self.healthy()):
            return []  # nothing here could stop them: they stop by themselves (orphan timeout)
        client = self.client()
        running = {run["id"]: process for run in client.post("/flow_runs/filter", {
            "flow_runs": {"state": {"type": {"any_": ["RUNNING", "CANCELLING"]}}},
            "work_pools": {"name": {"any_": [self.pool]}}}).json()
            if (process := self._started_by_its_workers(run.get("infrastructure_pid"))) is not None}
        if not running:
            return []
        say(f"cancelling {len(running)} flow run(s) of this stack's workers first (training saves "
            f"an emergency checkpoint; up to {timeout_s:.0f} s; Ctrl-C again stops without waiting)")
        worker = self.worker.pid if self.worker is not None and self.worker.poll() is None else None
        orphans = {flow_run: process for flow_run, process in running.items()
                   if worker is None or worker not in {p.pid for p in process.parents()}}
        for flow_run in running:
            client.post(f"/flow_runs/{flow_run}/set_state", {"state": {
                "type": "CANCELLING", "name": "Cancelling",
                "message": "goodput server is stopping"}, "force": True})
        for process in orphans.values():
            with contextlib.suppress(Exception):
                process.terminate()
        deadline = time.monotonic() + timeout_s
        for flow_run in running:
            with contextlib.suppress(TimeoutError):
                client.wait_final(flow_run, max(1.0, deadline - time.monotonic()))
        # Their engine, terminated without a worker's intent, calls them Crashed (or leaves
        # them Cancelling): once the process is gone, Cancelled, as a worker's cancel sets it.
        for flow_run, process in orphans.items():
            with contextlib.suppress(Exception):
                process.wait(max(1.0, deadline - time.monotonic()))
                if client.flow_run(flow_run)["state"]["type"] != "CANCELLED":
                    client.post(f"/flow_runs/{flow_run}/set_state", {"state": {
                        "type": "CANCELLED", "name": "Cancelled",
                        "message": "goodput server is stopping"}, "force": True})
        return list(running)

    def _started_by_its_workers(self, pid: str | None):
        """The process of a flow run's `infrastructure_pid` where this stack's workers started
        it on this machine, the running worker or one it replaced (an orphan by then, no longer
        its child): it carries the STACK_MARK its worker was given. None otherwise."""
        import psutil

        with contextlib.suppress(psutil.Error, OSError, ValueError, TypeError):
            process = psutil.Process(int(pid))
            if process.environ().get(STACK_MARK) == str(self.directory):
                return process
        return None

    def stop(self, say: Callable[[str], None] = lambda message: None) -> None:
        # Flow runs under way first, while the worker can still stop them: stopped with it,
        # their workers trained on unsupervised, and the server, back, called them Crashed.
        try:
            self.cancel_flow_runs(say=say)
        except KeyboardInterrupt:  # a second Ctrl-C: stop the rest without waiting
            say("not waiting for the flow runs; their training workers stop by themselves "
                "(launch.orphan_timeout_s)")
        except Exception as e:  # the API away: they stop by themselves (orphan timeout)
            say(f"flow runs not cancelled ({e}); their training workers stop by themselves "
                "(launch.orphan_timeout_s)")
        # A worker ignores SIGTERM while flow runs are under way and can leave a child
        # behind (STACK_NOTES): its whole group goes, then the server, then the database.
        _end(self.worker, signal.SIGKILL)
        _end(self.server, signal.SIGTERM)
        self.postgres.stop()

    # -- helpers ------------------------------------------------------------------------------

    def prefect(self, *args: str, cwd: Path | None = None, check: bool = True,
                timeout: float = 120) -> bool:
        """A `prefect` CLI command against this stack; True when it succeeded."""
        proc = subprocess.run([_prefect(), *args], env=self._env(), cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"prefect {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        return proc.returncode == 0

    def _spawn(self, name: str, argv: list[str], **env: str) -> subprocess.Popen:
        with open(self.log(name), "ab") as log:
            return subprocess.Popen(argv, env=self._env(**env), stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=subprocess.STDOUT, cwd=self.directory,
                                    start_new_session=True)


class StackClient:
    """The stack's REST API with its auth string, as the UI and other clients reach it: what
    the tests and benchmarks/orchestrator_bench.py trigger and watch flow runs with."""

    FINAL = ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")

    def __init__(self, api_url: str, auth_string: str):
        import httpx

        self.url, self.auth = api_url, tuple(auth_string.split(":", 1))
        # One client for every request: a new one loads the CA bundle into an SSL context
        # first (tens of ms of CPU, more on a busy machine), for a plain-HTTP API.
        self.http = httpx.Client(auth=self.auth, timeout=60)

    def post(self, path: str, body: dict) -> httpx.Response:
        """POST, tried again while the server is away or busy (a restart, a loaded machine)."""
        import httpx

        for delay in (1, 2, 4, 8, 0):
            try:
                response = self.http.post(f"{self.url}{path}", json=body)
                if response.status_code < 500 or not delay:
                    response.raise_for_status()
                    return response
            except httpx.TransportError:
                if not delay:
                    raise
            time.sleep(delay)

    def deployment(self, name: str) -> str:
        """The id of deployment `flow/deployment`."""
        flow, deployment = name.split("/")
        return self.post("/deployments/filter", {
            "flows": {"name": {"any_": [flow]}},
            "deployments": {"name": {"any_": [deployment]}}}).json()[0]["id"]

    def trigger(self, name: str, parameters: dict) -> str:
        """A flow run of the deployment, as the UI's Run button makes it; its id."""
        return self.post(f"/deployments/{self.deployment(name)}/create_flow_run",
                         {"parameters": parameters, "idempotency_key": secrets.token_hex(8)}
                         ).json()["id"]

    def flow_run(self, flow_run_id: str) -> dict:
        return self.post("/flow_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}}).json()[0]

    def wait_final(self, flow_run_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.flow_run(flow_run_id)
            if run["state"]["type"] in self.FINAL:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {flow_run_id} still {run['state']['type']} after "
                                   f"{timeout_s:.0f}s")
            time.sleep(2)

    def logs(self, flow_run_id: str) -> list[dict]:
        return self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}},
                                          "sort": "TIMESTAMP_ASC", "limit": 200}).json()

    def events(self, prefix: str, run_id: str) -> list[dict]:
        return self.post("/events/filter", {
            "filter": {"event": {"prefix": [prefix]},
                       "any_resource": {"labels": {"goodput.run-id": [run_id]}}},
            "limit": 50}).json()["events"]


def _say_on_stderr(message: str) -> None:
    print(f"goodput: server: {message}", file=sys.stderr, flush=True)


def _prefect() -> str:
    return str(Path(sys.executable).with_name("prefect"))


def _end(proc: subprocess.Popen | None, sig: int, group: bool = True, grace_s: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
