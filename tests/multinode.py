"""A multi-node Ray cluster on one machine, for tests and developers (issue 18).

A head node with no CPUs (the driver and Ray's control plane only, like deploy/cluster.yaml's head) and
worker nodes that each offer one `engine_slot`, a custom resource standing in for a GPU: the batch job
with `runtime.accelerator_resource=engine_slot` places one engine actor per worker node. Every node is its
own raylet with its own object store (`ray.cluster_utils.Cluster`, what Ray's own tests use), so killing
a worker node loses its actors and the objects it held, as a preempted GPU node would.

    from multinode import start_cluster, stop_cluster
    mn = start_cluster()            # head + 2 workers; mn.address for runtime.ray_address
    ...
    stop_cluster(mn)                # and `leftover_processes(mn)` is empty

The cluster lives under its own short temp dir (RAY_TMPDIR while it starts): Ray records "the current
cluster" in its temp dir, and a plain `ray.init()` elsewhere on the machine (other tests, another
engineer's runs) must not find and join this one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

ENGINE_RESOURCE = "engine_slot"
OBJECT_STORE_BYTES = 100 * 1024**2
WORKER_CPUS = 2  # logical: the engine actor (0.5) plus the light read/tokenize/write stages
# The GCS marks a silent node dead after `failure_threshold` missed health checks, only then are its
# actors restarted elsewhere: Ray's defaults (every 3 s, 10 s timeout, 5 misses) take 15-30 s; 1 s
# checks keep node-loss tests short, 5 misses keep a busy 2-core machine from losing healthy nodes.
HEALTH_CHECK = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 5}


@dataclass
class MultiNode:
    cluster: object                 # ray.cluster_utils.Cluster
    temp_dir: str
    workers: list = field(default_factory=list)  # ray._private.node.Node, in the order added
    previous_tmpdir: str | None = None

    @property
    def address(self) -> str:
        return self.cluster.address

    def add_worker(self, wait: bool = True):
        node = self.cluster.add_node(wait=wait, num_cpus=WORKER_CPUS, resources={ENGINE_RESOURCE: 1},
                                     object_store_memory=OBJECT_STORE_BYTES)
        self.workers.append(node)
        return node

    def kill_worker(self, node):
        """Node loss: SIGKILL its raylet, object store, agents and workers at once (no graceful drain)."""
        doomed = _descendants(node.all_processes["raylet"][0].process.pid)
        self.cluster.remove_node(node, allow_graceful=False)
        _sigkill(doomed)
        self.workers.remove(node)

    def kill_head(self):
        """The head's GCS, dashboard and its raylet's agents, SIGKILL: the cluster is gone."""
        doomed = _descendants(self.cluster.head_node.all_processes["raylet"][0].process.pid)
        self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
        _sigkill(doomed)

    def actors(self, class_contains: str) -> list[dict]:
        """The GCS actor table's entries (alive and dead) whose class name contains `class_contains`:
        ActorID, State, Pid, Address.NodeID, NumRestarts."""
        table = self.cluster.global_state.actor_table(None)
        return [a for a in table.values() if class_contains in a["ActorClassName"]]

    def alive_node_ids(self) -> set[str]:
        return {n["NodeID"] for n in self.cluster.global_state.node_table() if n["Alive"]}


def start_cluster(workers: int = 2, include_dashboard: bool = False) -> MultiNode:
    """Start the cluster; once more if a node misses Ray's fixed 30 s to register with the GCS, which a
    2-core machine under other load does (seen with load averages of 10-17)."""
    try:
        return _start_cluster(workers, include_dashboard)
    except Exception as exc:
        if "timed out during startup" not in str(exc):
            raise
        return _start_cluster(workers, include_dashboard)


def _start_cluster(workers: int, include_dashboard: bool) -> MultiNode:
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="raymn-", dir="/tmp")  # short: Unix socket paths live under it
    previous = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp_dir  # until stop_cluster: Ray reads it again when nodes are added
    # Free ports, not Ray's defaults (8265, 52365): a `ray start --head` elsewhere on the machine has those.
    head = {"num_cpus": 0, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": include_dashboard,
            "dashboard_host": "127.0.0.1", "dashboard_port": _free_port(), "dashboard_agent_listen_port": _free_port(),
            "_system_config": HEALTH_CHECK}
    mn = MultiNode(None, temp_dir, previous_tmpdir=previous)
    try:
        mn.cluster = Cluster(initialize_head=True, connect=False, head_node_args=head)
        for _ in range(workers):
            mn.add_worker()
        mn.cluster.wait_for_nodes()
        return mn
    except BaseException:
        stop_cluster(mn)
        raise


def stop_cluster(mn: MultiNode):
    """Kill every node (workers first, then the head) and remove the temp dir. Not Cluster.shutdown():
    that also resets this process's internal-KV client, which a session's own Ray connection uses."""
    from ray._common.utils import reset_ray_address

    if mn.cluster is not None:
        for node in list(mn.cluster.worker_nodes):
            mn.kill_worker(node) if node in mn.workers else mn.cluster.remove_node(node, allow_graceful=False)
        if mn.cluster.head_node is not None:
            mn.kill_head()
    reset_ray_address(mn.temp_dir)
    _wait_gone(mn, timeout=20)
    if mn.previous_tmpdir is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = mn.previous_tmpdir
    shutil.rmtree(mn.temp_dir, ignore_errors=True)


def leftover_processes(mn: MultiNode) -> list[str]:
    """'pid command' of live processes that belong to this cluster: every process a node starts (raylet,
    GCS, agents, workers; their command lines are often rewritten to `ray::...`) holds files open under
    the cluster's temp dir (sockets, logs), and the drivers the tests start inherit RAY_TMPDIR=<it>."""
    return [f"{pid} {_command(pid)}" for pid in _pids_using(mn.temp_dir)]


def _pids_using(temp_dir: str) -> list[int]:
    tag = f"RAY_TMPDIR={temp_dir}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie is already dead; its parent reaps it
            with open(f"/proc/{entry}/environ", "rb") as f:
                tagged = tag in f.read().split(b"\0")
            if tagged or any(os.readlink(f"/proc/{entry}/fd/{fd}").startswith(temp_dir)
                             for fd in os.listdir(f"/proc/{entry}/fd")):
                found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (a node's raylet starts its agents and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
        except (OSError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        found.append(todo.pop())
        todo += children.get(found[-1], [])
    return found


def _sigkill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(mn: MultiNode, timeout: float):
    # Agents of a killed raylet exit on their own only after a while: what is left after a short grace
    # is killed by pid (only processes using this cluster's temp dir, see leftover_processes).
    deadline = time.monotonic() + timeout
    while _pids_using(mn.temp_dir) and time.monotonic() < deadline:
        if time.monotonic() > deadline - timeout * 0.75:
            _sigkill(_pids_using(mn.temp_dir))
        time.sleep(0.5)


@contextmanager
def running_cluster(node_env: dict[str, str] | None = None, **kwargs):
    """`start_cluster(**kwargs)` for the body, then stopped; checks nothing is left behind. `node_env`: set
    in this process while the nodes start, so that they (and the workers they start) inherit it."""
    saved = {k: os.environ.get(k) for k in node_env or {}}
    os.environ.update(node_env or {})
    try:
        mn = start_cluster(**kwargs)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        yield mn
    finally:
        stop_cluster(mn)
    assert leftover_processes(mn) == []
    shutil.rmtree(mn.temp_dir, ignore_errors=True)  # a node killed mid-write may have recreated empty dirs


@pytest.fixture
def multinode_cluster():
    """A fresh head + 2 worker cluster per test (node-loss tests change it)."""
    with running_cluster() as mn:
        yield mn
