"""A two-node Ray cluster on this machine: actors spread over the nodes, and losing a node is survived.

Ray declares a node dead after its health checks fail (about 12 s by
default); the module shortens them so that this takes a second or two.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest

ray = pytest.importorskip("ray")

from helpers import driver_path_env  # noqa: E402
from nn_handler import ParallelExecutor, WorkerDiedError  # noqa: E402

HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "0", "RAY_health_check_period_ms": "300",
                 "RAY_health_check_timeout_ms": "300", "RAY_health_check_failure_threshold": "3"}


def node_of(device):
    import ray

    return ray.get_runtime_context().get_node_id()


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in HEALTH_CHECKS}
    os.environ.update(HEALTH_CHECKS)  # read by the cluster's processes as they start
    made = None
    try:
        made = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        made.add_node(num_cpus=1)
        ray.init(address=made.address, runtime_env=driver_path_env(), log_to_driver=False)
        made.wait_for_nodes()
        yield made
    finally:
        ray.shutdown()
        if made is not None:
            made.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_actors_spread_and_a_lost_node_is_a_worker_died_error_naming_it(cluster):
    head = cluster.head_node.node_id
    second = [n for n in cluster.list_all_nodes() if n.node_id != head][0]
    with ParallelExecutor(device_ids=["cpu", "cpu"], backend="ray", timeout=150) as ex:
        # One CPU per node: Ray must put one actor on each.
        assert set(ex.run(node_of)) == {head, second.node_id}
        with concurrent.futures.ThreadPoolExecutor(1) as caller:
            running = caller.submit(ex.run, lambda device: time.sleep(120))
            time.sleep(2)  # both actors are in the call
            started = time.monotonic()
            cluster.remove_node(second, allow_graceful=False)
            with pytest.raises(WorkerDiedError) as info:
                running.result(timeout=100)
        # Long before the call would end: the lost node fails it (Ray's health checks, slower on loaded cores).
        assert time.monotonic() - started < 90
        lost = [f for f in info.value.failures if f.node == second.node_id]
        assert lost and second.node_id[:12] in str(info.value)
        # A new node takes the place of the lost one: the actor restarts there and the next call runs.
        third = cluster.add_node(num_cpus=1)
        assert set(ex.run(node_of)) == {head, third.node_id}
    cluster.remove_node(third)  # its processes are this test's children
