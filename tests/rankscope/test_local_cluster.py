"""LocalCluster's configuration, without starting it (tests/integration/test_three_broker_cluster.py
starts one and kills a node)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankscope.cli.stack.broker import BrokerError, LocalBroker
from rankscope.cli.stack.broker_cluster import CLUSTER_JVM_OPTS, LocalCluster
from rankscope.config import Settings


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_three_nodes_form_one_quorum_with_replicated_internal_topics(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    cluster = LocalCluster(s, nodes=3, ports=[(29092, 29093), (29094, 29095), (29096, 29097)])
    assert cluster.bootstrap == "127.0.0.1:29092,127.0.0.1:29094,127.0.0.1:29096"
    voters = "1@127.0.0.1:29093,2@127.0.0.1:29095,3@127.0.0.1:29097"
    homes = set()
    for i, node in enumerate(cluster.nodes, 1):
        props = _props(node.write_config().read_text())
        assert props == node.server_properties()
        assert props["node.id"] == str(i)
        assert props["process.roles"] == "broker,controller"
        assert props["controller.quorum.voters"] == voters
        assert props["listeners"] == f"PLAINTEXT://127.0.0.1:{29090 + 2 * i},CONTROLLER://127.0.0.1:{29091 + 2 * i}"
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{29090 + 2 * i}"
        for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                    "share.coordinator.state.topic.replication.factor", "default.replication.factor"):
            assert props[key] == "3", key
        for key in ("transaction.state.log.min.isr", "share.coordinator.state.topic.min.isr", "min.insync.replicas"):
            assert props[key] == "2", key
        assert node.home == tmp_path.resolve() / "kafka-cluster" / f"node-{i}"
        assert props["log.dirs"] == str(node.home / "data")
        assert node.jvm_opts == CLUSTER_JVM_OPTS
        homes.add(node.home)
    assert len(homes) == 3
    cid = cluster.cluster_id()
    assert len(cid) == 22 and cluster.cluster_id() == cid   # made once, then read back
    assert cluster.pids() == {1: None, 2: None, 3: None}


def test_default_ports_step_by_two_and_ports_must_differ(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), kafka_port=19092, kafka_controller_port=19093)
    assert LocalCluster(s).bootstrap == "127.0.0.1:19092,127.0.0.1:19094,127.0.0.1:19096"
    with pytest.raises(BrokerError, match="must all differ"):
        LocalCluster(s, nodes=2, ports=[(19092, 19093), (19093, 19094)])
    with pytest.raises(BrokerError, match="port pairs"):
        LocalCluster(s, nodes=3, ports=[(19092, 19093)])


def test_a_single_broker_keeps_its_configuration(tmp_path: Path) -> None:
    s = Settings(data_dir=str(tmp_path), kafka_port=19092, kafka_controller_port=19093)
    props = LocalBroker(s).server_properties()
    assert props["node.id"] == "1" and props["controller.quorum.voters"] == "1@127.0.0.1:19093"
    assert "min.insync.replicas" not in props and props["offsets.topic.replication.factor"] == "1"
