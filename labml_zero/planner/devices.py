r"""
---
title: The machines a plan is for
summary: Named GPUs with their data-sheet peak, memory, memory bandwidth and
  links, and a cluster of them (GPUs per node, nodes, host memory), read from
  this machine or named on the command line.
---

# The machines a plan is for

A plan needs five numbers of a GPU, each the roofline of one kind of work in a
step: the dense bf16 peak $P$ (matrix products), the memory bandwidth $W$
(element-wise work and the optimizer's update), the memory $M$ that the peak
must fit, and two links: the one to the host, $\beta$ (offloaded optimizer
state), and the one to the other GPUs (collectives). A cluster is $n$ GPUs on
each of $h$ nodes,

$$N_d = n\,h,$$

and the host memory of a node, which holds the offloaded state of its $n$ ranks.

## Limitations

* Three GPUs are named; another GPU has no known peak to plan with.
* One bandwidth per link, at large messages.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

__all__ = ["GPU", "GPUS", "Cluster", "gpu_by_name", "this_machine", "GIB",
           "H100_ELEMENTWISE_FACTOR"]

# binary units, as PyTorch's memory figures and `--host-gib` count them
GIB = 1024**3


@dataclass(frozen=True)
class GPU:
    """
    ## One GPU's rooflines
    """

    name: str
    """The short name a user types (`h200`)."""
    cuda_name: str
    """The fragment of `torch.cuda.get_device_name` that names it."""
    peak_flops: float
    """$P$: dense bf16 tensor-core FLOP/s from the data sheet (not 2:4 sparse),
    the figure MFU is counted against."""
    memory_bytes: int
    """$M$: device memory as PyTorch reports it."""
    memory_bandwidth: float
    """$W$: HBM bytes/s from the data sheet."""
    host_link: float
    r"""$\beta$: bytes/s each way between host and device with pinned
    memory, both ways at once."""
    peer_bus_bandwidth: float
    """NCCL's bus bandwidth of an all-gather or reduce-scatter over the GPUs
    of one node, at large sizes (NVLink through NVSwitch)."""
    node_bus_bandwidth: float
    """The same for a ring that crosses nodes: one InfiniBand NIC per GPU."""
    peak_flops_fp8: float | None = None
    """$P_8$: dense fp8 tensor-core FLOP/s from the data sheet; `None` for a
    GPU without fp8 products."""
    elementwise_bandwidth: float | None = None
    """$W_e$: the rate at which the roofline times the layers' element-wise
    kernels and the readout's, where the benchmark measured one other than
    $W$; `None`: $W$."""
    host_update_rate: float | None = None
    """$R_h$: offloaded elements per second that the host of the machine
    this GPU came in updates (AdamW and the rounding to the parameter's
    dtype), where the benchmark measured one other than the [step
    time](step_time.html)'s `HOST_UPDATE_RATE`; `None`: that rate."""


# ## The table
#
# Each figure's source: peaks and HBM bandwidths from NVIDIA's data sheets
# (SXM parts); memory as PyTorch reports it (the out-of-memory message's
# "total capacity"); the host link is PCIe 5 (PCIe 4 for the A100) at the rate
# a pinned copy reaches, below the signalling rate; the bus bandwidth within a
# node is what nccl-tests' all-gather reaches over an HGX board's GPUs at large
# sizes, below NVLink's rate each way; across nodes each GPU has one InfiniBand
# NIC (NDR, HDR for the A100), of which a ring reaches about nine tenths.

# The element-wise bytes of the [step time](step_time.html) were fitted on the
# H200, at its $W$. The H100 has the same SMs at the same clocks and less
# bandwidth, and its element-wise kernels and readout ran faster than its $W$
# allows against that fit: they are not bound by the memory alone at these
# sizes. Their rate on the H100 is its $W$ times this factor, the
# least-squares solution over its bf16 lines in the benchmark's results
# (tested: tests/planner/test_step_time.py::test_an_h100s_element_wise_rate_is_the_bench_fit).
H100_ELEMENTWISE_FACTOR = 1.28

# The step time's host rate was timed on the H200's host. The H100's host
# updated faster: on the lines of {{see: W2-1O}} whose host update outlasted
# the backward pass (two and four sequences, with and without recomputation),
# the step is the rest plus the offloaded elements over this rate, and this is
# the least-squares solution over those lines' relative errors
# (tested: tests/planner/test_step_time.py::test_an_h100s_host_update_rate_is_the_bench_fit).
H100_HOST_UPDATE_RATE = 3.9e9

GPUS = {
    "h100": GPU("h100", "H100", peak_flops=989.4e12,
                memory_bytes=int(79.1 * GIB), memory_bandwidth=3.35e12,
                host_link=55e9, peer_bus_bandwidth=360e9,
                node_bus_bandwidth=45e9, peak_flops_fp8=1978.9e12,
                elementwise_bandwidth=H100_ELEMENTWISE_FACTOR * 3.35e12,
                host_update_rate=H100_HOST_UPDATE_RATE),
    "h200": GPU("h200", "H200", peak_flops=989.4e12,
                memory_bytes=150_109_880_320, memory_bandwidth=4.8e12,
                host_link=55e9, peer_bus_bandwidth=360e9,
                node_bus_bandwidth=45e9, peak_flops_fp8=1978.9e12),
    "a100": GPU("a100", "A100", peak_flops=312e12,
                memory_bytes=int(79.15 * GIB), memory_bandwidth=2.039e12,
                host_link=26e9, peer_bus_bandwidth=230e9,
                node_bus_bandwidth=22e9),
}


def gpu_by_name(name: str) -> GPU:
    """A GPU of the table by its short name; one line naming the choices."""
    gpu = GPUS.get(name.lower())
    if gpu is None:
        raise ValueError(f"unknown GPU {name!r}; expected one of "
                         f"{', '.join(GPUS)}")
    return gpu


@dataclass(frozen=True)
class Cluster:
    """
    ## The GPUs a job runs on
    """

    gpu: GPU
    gpus_per_node: int = 1
    """$n$."""
    nodes: int = 1
    """$h$."""
    host_bytes: int | None = None
    """A node's host memory; `None`: not known, so not checked."""

    def __post_init__(self):
        for name in ("gpus_per_node", "nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.host_bytes is not None and self.host_bytes <= 0:
            raise ValueError(f"host memory must be > 0 bytes, got {self.host_bytes}")

    @property
    def world_size(self) -> int:
        """$N_d = n h$."""
        return self.gpus_per_node * self.nodes

    @property
    def bus_bandwidth(self) -> float:
        """The collectives' bus bandwidth: NVLink within a node; a ring over
        several nodes runs at the pace of its slowest hop, the NIC."""
        return (self.gpu.peer_bus_bandwidth if self.nodes == 1
                else self.gpu.node_bus_bandwidth)

    def group_bus_bandwidth(self, group: int) -> float:
        """The bus bandwidth of a collective over `group` consecutive ranks:
        NVLink where every such group lies within one node, as hybrid
        sharding's shard groups of a node's GPUs do."""
        return (self.gpu.peer_bus_bandwidth if self.gpus_per_node % group == 0
                else self.bus_bandwidth)

    def describe(self) -> str:
        host = ("host memory not given" if self.host_bytes is None
                else f"{self.host_bytes / GIB:,.0f} GiB host memory a node")
        nodes = f" x {self.nodes} nodes" if self.nodes > 1 else ""
        return (f"{self.gpus_per_node} x {self.gpu.name}{nodes} "
                f"({self.gpu.memory_bytes / GIB:.1f} GiB each, {host})")


def host_memory_bytes() -> int | None:
    """This machine's physical memory, or `None` where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def this_machine(*, gpus: int | None = None) -> Cluster | None:
    """
    ### The cluster this process sees: its GPUs and its memory

    The GPU is found in the table by its CUDA name; its memory is the one
    CUDA reports (`mem_get_info`'s total). `None` without CUDA, or for a GPU
    the table does not name (its peak is unknown).
    """
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    gpu = next((g for g in GPUS.values() if g.cuda_name in name), None)
    if gpu is None:
        return None
    _, total = torch.cuda.mem_get_info(0)
    gpu = replace(gpu, memory_bytes=total)
    return Cluster(gpu, gpus_per_node=gpus or torch.cuda.device_count(),
                   host_bytes=host_memory_bytes())
