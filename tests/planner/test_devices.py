"""`labml_zero/planner/devices.py`: the named GPUs, a cluster's ranks and
links, and this machine read from CUDA (none on a CPU machine)."""

import pytest
import torch

from labml_zero.planner.devices import GIB, GPUS, Cluster, gpu_by_name, this_machine
from labml_zero.planner.memory_budget import H200_BYTES


def test_the_table_names_each_gpu_and_its_rooflines():
    assert gpu_by_name("H200") is GPUS["h200"]
    # the memory budget's H200 is the planner's, as PyTorch reports it
    assert GPUS["h200"].memory_bytes == H200_BYTES
    for gpu in GPUS.values():
        assert gpu.peer_bus_bandwidth > gpu.host_link > 0
        assert gpu.peer_bus_bandwidth > gpu.node_bus_bandwidth
    with pytest.raises(ValueError, match="^unknown GPU 'v100'; expected one of "
                                         "h100, h200, a100$"):
        gpu_by_name("v100")


def test_a_cluster_counts_its_ranks_and_its_slowest_link():
    one = Cluster(GPUS["h100"], gpus_per_node=8)
    two = Cluster(GPUS["h100"], gpus_per_node=8, nodes=2, host_bytes=1000 * GIB)
    assert (one.world_size, two.world_size) == (8, 16)
    assert one.bus_bandwidth == GPUS["h100"].peer_bus_bandwidth
    assert two.bus_bandwidth == GPUS["h100"].node_bus_bandwidth
    assert "8 x h100 x 2 nodes" in two.describe()
    with pytest.raises(ValueError, match="nodes must be >= 1, got 0"):
        Cluster(GPUS["h100"], nodes=0)


def test_this_machine_needs_a_gpu_it_knows():
    if not torch.cuda.is_available():
        assert this_machine() is None
    else:
        here = this_machine()
        assert here is None or here.world_size == torch.cuda.device_count()
