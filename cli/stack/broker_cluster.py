"""A local Apache Kafka cluster of N KRaft nodes (cli/stack/broker.py's broker, N times).

:class:`LocalCluster` starts N nodes on 127.0.0.1 (each a combined broker + controller, all of them
voters of one KRaft quorum, one cluster id formatted into each node's storage) under
``<data_dir>/kafka-cluster/node-<id>/``: for tests of replication and of a broker lost mid-job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from rankscope.cli.stack.admin import admin_client
from rankscope.cli.stack.broker import BrokerError, LocalBroker, new_cluster_id
from rankscope.config import Settings

log = logging.getLogger(__name__)

# Each node of a LocalCluster: three JVMs share a small machine.
CLUSTER_JVM_OPTS = ["-Xms128m", "-Xmx384m"]


class LocalCluster:
    """N KRaft nodes on 127.0.0.1, each a combined broker + controller and a voter of one quorum.

    Node ``i`` (1-based) listens on ``ports[i-1]`` (broker port, controller port); by default
    ``settings.kafka_port + 2*(i-1)`` and ``settings.kafka_controller_port + 2*(i-1)``. Each node has
    its own home (``<data_dir>/kafka-cluster/node-<i>``: config, data, logs, pid file); all are
    formatted with the one cluster id kept in ``<data_dir>/kafka-cluster/cluster.id``. The internal
    topics get ``min(3, N)`` replicas and a min ISR one less, as does the cluster's default for topics
    created without their own settings; each JVM gets a smaller heap (:data:`CLUSTER_JVM_OPTS`).
    """

    def __init__(self, settings: Settings, nodes: int = 3, ports: Sequence[tuple[int, int]] | None = None,
                 jvm_opts: Sequence[str] = tuple(CLUSTER_JVM_OPTS)) -> None:
        if nodes < 1:
            raise BrokerError(f"a cluster needs at least one node, got {nodes}")
        ports = list(ports) if ports is not None else [
            (settings.kafka_port + 2 * i, settings.kafka_controller_port + 2 * i) for i in range(nodes)]
        if len(ports) != nodes:
            raise BrokerError(f"{nodes} nodes need {nodes} (broker, controller) port pairs, got {len(ports)}")
        flat = [p for pair in ports for p in pair]
        if len(set(flat)) != len(flat):
            raise BrokerError(f"the cluster's ports must all differ, got {ports}")
        self.settings = settings
        self.home = Path(settings.data_dir).expanduser().resolve() / "kafka-cluster"
        self.cluster_id_path = self.home / "cluster.id"
        voters = {i + 1: ctrl for i, (_, ctrl) in enumerate(ports)}
        replication = min(3, nodes)
        self.nodes = [LocalBroker(settings, node_id=i + 1, port=port, controller_port=ctrl, voters=voters,
                                  home=self.home / f"node-{i + 1}", cluster_id=None, replication=replication,
                                  jvm_opts=jvm_opts)
                      for i, (port, ctrl) in enumerate(ports)]

    @property
    def bootstrap(self) -> str:
        """Every node's PLAINTEXT address, comma-separated (for ``bootstrap_servers``)."""
        return ",".join(n.bootstrap for n in self.nodes)

    def node(self, node_id: int) -> LocalBroker:
        return self.nodes[node_id - 1]

    def pids(self) -> dict[int, int | None]:
        return {n.node_id: n.pid() for n in self.nodes}

    def cluster_id(self) -> str:
        """The cluster id every node is formatted with (made once, then read back)."""
        self.home.mkdir(parents=True, exist_ok=True)
        try:
            cid = self.cluster_id_path.read_text().strip()
            if cid:
                return cid
        except OSError:
            pass
        cid = new_cluster_id()
        self.cluster_id_path.write_text(cid + "\n")
        return cid

    def start(self, timeout_s: float = 120.0) -> str:
        """Start every node that is not running (all are launched before any is waited on: a node
        serves only once a majority of the voters has elected a leader), then wait until each answers
        and the cluster's metadata lists every broker. Returns the bootstrap list."""
        self.home.mkdir(parents=True, exist_ok=True)
        cid = self.cluster_id()
        deadline = time.monotonic() + timeout_s
        t0 = time.monotonic()
        with contextlib.ExitStack() as locks:
            for n in self.nodes:
                n.home.mkdir(parents=True, exist_ok=True)
                locks.enter_context(n._lock(n.home / ".lock"))
            launched: dict[int, subprocess.Popen[bytes]] = {}
            try:
                for n in self.nodes:
                    if not n.is_running():
                        n.cluster_id = cid
                        launched[n.node_id] = n.launch()
                for n in self.nodes:
                    n._wait_ready(max(deadline - time.monotonic(), 1.0), proc=launched.get(n.node_id))
                self._wait_all_brokers(deadline)
            except BrokerError:
                for node_id in launched:
                    self.node(node_id).stop(timeout_s=10)
                raise
        log.info("Kafka %s cluster of %d nodes ready at %s in %.1fs (pids %s)", self.nodes[0].version,
                 len(self.nodes), self.bootstrap, time.monotonic() - t0, self.pids())
        return self.bootstrap

    def kill9(self, node_id: int) -> int:
        """SIGKILL one node's ``java`` process (a broker and a controller lost at once). Returns its pid."""
        pid = self.node(node_id).kill9()
        if pid is None:
            raise BrokerError(f"node {node_id} of the cluster in {self.home} is not running")
        log.warning("killed Kafka node %d (pid %d) with SIGKILL", node_id, pid)
        return pid

    def stop(self, timeout_s: float = 30.0) -> list[int]:
        """SIGTERM every running node at once (one by one, the last ones would wait for a quorum
        that is gone), wait up to ``timeout_s``, then SIGKILL. Returns the node ids that were running."""
        running = {n.node_id: pid for n in self.nodes if (pid := n.pid()) is not None}
        for pid in running.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for node_id, pid in running.items():
            node = self.node(node_id)
            if not node._wait_exit(pid, max(deadline - time.monotonic(), 0.1)):
                log.warning("Kafka node %d (pid %d) ignored SIGTERM for %.0fs; killing it", node_id, pid, timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                node._wait_exit(pid, 10)
            node.pid_path.unlink(missing_ok=True)
            node._proc = None
        return sorted(running)

    def _wait_all_brokers(self, deadline: float) -> None:
        client = admin_client(self.bootstrap)
        seen: set[int] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                seen = set(client.list_topics(timeout=2.0).brokers)
                if seen >= {n.node_id for n in self.nodes}:
                    return
            time.sleep(0.2)
        raise BrokerError(f"Kafka cluster at {self.bootstrap} lists brokers {sorted(seen)}, not all of "
                          f"{[n.node_id for n in self.nodes]}.\n" + "\n".join(n._diagnostics(10) for n in self.nodes))
