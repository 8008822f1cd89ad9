"""A Ray cluster of real nodes on one machine: each node a network namespace with its own address on a private
bridge, started with the project's own launch/ray_head.sh and launch/ray_worker.sh, torn down whatever happens.

Needs root (or CAP_NET_ADMIN) and iproute2's `ip`; `why_no_namespaces()` says why not where they are missing.
Nothing leaves the bridge: it has no address in the host's namespace, and no namespace has a default route.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBNET = "10.213.{tag}.{host}"  # private; only the namespaces here hold addresses in it
IFACE = "rleth0"  # each namespace's end of its link (namespaces keep interface names apart)
PORT = 6379


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def why_no_namespaces() -> str | None:
    """None where this process can create network namespaces; else the reason, for a skip."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install -y iproute2)"
    probe = f"rlsys-probe-{os.getpid()}"
    out = ip("netns", "add", probe, check=False)
    if out.returncode:
        return f"cannot create a network namespace (`ip netns add`: {out.stderr.strip()}); needs root or CAP_NET_ADMIN"
    ip("netns", "del", probe, check=False)
    return None


class Node:
    def __init__(self, cluster: "Cluster", name: str, host: int):
        self.name, self.netns = name, f"rl{cluster.tag}-{name}"
        self.address = SUBNET.format(tag=cluster.tag, host=host)
        self.veth = f"rl{cluster.tag}{name[0]}{host}"  # the host's end, on the bridge (15 characters at most)
        self.temp_dir = Path(cluster.base) / name  # Ray's session files: one tree per node, as on separate machines

    def run(self, cmd: list[str], env: dict, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.netns, *cmd], env=env, cwd=ROOT, capture_output=True,
                              text=True, **kwargs)

    def pids(self) -> list[int]:
        out = ip("netns", "pids", self.netns, check=False).stdout.split()
        return [int(p) for p in out]

    def kill(self) -> None:
        """Stop every process in this node: its raylet, object store and actors, as when the machine dies."""
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Cluster:
    """`with Cluster(workers=1) as c:` a head and `workers` worker nodes, each with `cpus` CPUs and `gpus`
    logical GPUs (a Ray resource only: placement plans need one, and the engines and ranks still run on CPU);
    `head_cpus` and `head_gpus` set the head's apart."""

    def __init__(self, workers: int = 1, cpus: int = 4, gpus: int = 1, head_gpus: int | None = None,
                 head_cpus: int | None = None, object_store_mb: int = 256):
        self.tag = os.getpid() % 250 + 1  # concurrent test runs get their own names and subnets
        self.base = tempfile.mkdtemp(prefix="rlmn")  # short: Ray's socket paths must fit 107 characters
        self.bridge = f"rlbr{self.tag}"
        self.head = Node(self, "head", 1)
        self.workers = [Node(self, f"w{i + 1}", i + 2) for i in range(workers)]
        self.worker_resources = ["--num-cpus", str(cpus), "--num-gpus", str(gpus)]
        # head_gpus=0: no engine or rank on the head, so that any worker node may be lost;
        # head_cpus=0: no reward worker either (Ray puts CPU-only actors on GPU-less nodes first)
        self.head_resources = ["--num-cpus", str(cpus if head_cpus is None else head_cpus),
                               "--num-gpus", str(gpus if head_gpus is None else head_gpus)]
        self.object_store = str(object_store_mb * 1024 * 1024)
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
        # gloo finds its address from the hostname, which here belongs to the host: name the link instead.
        token = Path(self.base) / "auth_token"  # Ray's token auth: every node and client shows the head's token
        token.write_text(secrets.token_hex(32))
        self.env = dict(os.environ, PATH=path, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME=IFACE, RAY_DEDUP_LOGS="0",
                        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                        # a lost node is declared dead after ~3 s rather than Ray's default half a minute;
                        # the timeout bounds each check, or a cut link's unanswered checks take 10 s apiece
                        RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3",
                        RAY_health_check_timeout_ms="1000")

    @property
    def nodes(self) -> list[Node]:
        return [self.head, *self.workers]

    @property
    def gcs(self) -> str:
        return f"{self.head.address}:{PORT}"

    def __enter__(self) -> "Cluster":
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            ip("link", "set", self.bridge, "up")
            for node in self.nodes:
                self._link(node)
            self._start(self.head, ["bash", "launch/ray_head.sh", "--port", str(PORT)])
            for node in self.workers:
                self._start(node, ["bash", "launch/ray_worker.sh", "--address", self.gcs])
            self.wait_for_nodes(len(self.nodes))
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_worker(self) -> Node:
        """A worker node joining the running cluster (e.g. a spare, once a node is lost)."""
        node = Node(self, f"w{len(self.workers) + 1}", len(self.nodes) + 1)
        self.workers.append(node)  # before it exists, so that close() removes whatever was made
        self._link(node)
        self._start(node, ["bash", "launch/ray_worker.sh", "--address", self.gcs])
        self._wait(lambda alive: node.address in alive, f"{node.name} alive", 120)
        return node

    def _link(self, node: Node) -> None:
        """The node's namespace and its link to the bridge."""
        ip("netns", "add", node.netns)
        ip("link", "add", node.veth, "type", "veth", "peer", "name", IFACE, "netns", node.netns)
        ip("link", "set", node.veth, "master", self.bridge, "up")
        for args in (["addr", "add", f"{node.address}/24", "dev", IFACE], ["link", "set", IFACE, "up"],
                     ["link", "set", "lo", "up"]):
            ip("-n", node.netns, *args)

    def _start(self, node: Node, cmd: list[str]) -> None:
        resources = self.head_resources if node is self.head else self.worker_resources
        more = ["--", "--node-ip-address", node.address, "--temp-dir", str(node.temp_dir),
                "--object-store-memory", self.object_store, *resources]
        out = node.run([*cmd, *more], self.env, timeout=180)
        if out.returncode:
            raise RuntimeError(f"{cmd[1]} on {node.name} failed:\n{out.stdout}\n{out.stderr}")

    def python(self, code: str, node: Node | None = None, timeout: float = 120) -> str:
        """Run Python code on a node (the head by default), joined to the cluster as `ray`; its stdout."""
        prelude = f"import ray\nray.init(address={self.gcs!r}, logging_level='ERROR')\n"
        env = dict(self.env, RAY_ADDRESS=self.gcs)  # the state API's too (other Ray instances may run here)
        out = (node or self.head).run([sys.executable, "-c", prelude + code], env, timeout=timeout)
        if out.returncode:
            raise RuntimeError(f"python on {(node or self.head).name} failed:\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def alive(self) -> list[str]:
        """The addresses of the Ray nodes alive."""
        return self.python("print(*(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))").split()

    def wait_for_nodes(self, n: int, timeout_s: float = 120) -> None:
        self._wait(lambda alive: len(alive) == n, f"{n} Ray nodes alive", timeout_s)

    def _wait(self, done, what: str, timeout_s: float) -> None:
        """Until `done(self.alive())`."""
        deadline = time.monotonic() + timeout_s
        while not done(alive := self.alive()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"not {what} after {timeout_s:.0f} s: alive {alive}")
            time.sleep(2)

    def submit(self, *args: str, timeout: float = 480) -> subprocess.CompletedProcess:
        """launch/submit.py on the head, which holds the dashboard on its 127.0.0.1."""
        return self.head.run([sys.executable, "launch/submit.py", *args], self.env, timeout=timeout)

    def submit_background(self, *args: str, log: Path) -> subprocess.Popen:
        with open(log, "w") as f:
            return subprocess.Popen(["ip", "netns", "exec", self.head.netns, sys.executable, "launch/submit.py", *args],
                                    env=self.env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)

    def cut(self, node: Node) -> None:
        """Cut a node's link: it is still running, but nobody can reach it."""
        ip("link", "set", node.veth, "down")

    def close(self) -> None:
        """Stop every process in the namespaces and remove them, the links and the bridge; never raises."""
        for node in reversed(self.nodes):
            node.kill()
        for node in self.nodes:
            ip("link", "del", node.veth, check=False)
            ip("netns", "del", node.netns, check=False)
        ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.base, ignore_errors=True)
