r"""
---
title: Where a shard's optimizer state lives
summary: One home object per shard, device or host, chosen once when AdamFP16 is
  built; it holds the shard's optimizer states and moves its gradient and its
  update, so the optimizer never asks where a shard is.
---

# Where a shard's optimizer state lives

This page deepens [AdamFP16](adam_fp16.html). Each shard's states (those of
the optimizer's [state layout](../zero3/state_layout.html): by default the
fp32 master and two moments) live in one place, its *home*:
device memory (`DeviceHome`) or host memory (`HostHome`, the {{see: offload}} of
[optimizer state in host memory](host_offload.html)). Of the $p + 4 + K$
bytes a trainable element costs a rank, a shard of $S$ elements keeps on its
device

$$\underbrace{(p + 4 + K)\,S}_{\texttt{DeviceHome}} \quad\text{or}\quad
  \underbrace{(p + 4)\,S}_{\texttt{HostHome}},$$

and a host home holds the $K S$ bytes and a $4 S$-byte staging buffer in host
memory instead, and for a layout without a master a copy of the weight, $p S$
bytes more (see Note: a host home without a master).
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

import torch

from labml_zero.zero3.shard import LocalShard, grad_device
from labml_zero.zero3.state_layout import StateLayout

from . import kahan_summation, rounded_update
from .host_offload import HostOffload, HostShard, non_finite_flag


class ShardHome:
    """
    ## What every home answers

    * `param`: the shard (or any parameter) the home belongs to.
    * `group_index`: its param group's position in `optimizer.param_groups`
      (an index, not the group: `load_state_dict` replaces the groups).
    * `layout`: the optimizer's `StateLayout`, the states the home allocates.

    Set by each kind, once:

    * `found_inf(grad)`: the non-finite flag of the gradient the update
      reads, for an update during the backward pass;
    * `skip_in_kernel`: the fused kernel, when the optimizer uses it, may
      skip a non-finite gradient where the state is (a flag it reads, no host
      sync);
    * `copies_gradient`: the gradient is copied elsewhere as soon as it is
      final (`grad_ready`);
    * `one_pass`: the fused update and the write-back may run as one kernel
      ([the update in one pass](rounded_update.html));
    * `shard_beside_state`: the shard is in the state's memory, so an update
      may round the master into it as it writes the master (8-bit moments'
      [one pass](blockwise_moments.html)); otherwise `write_back` moves it;
    * `reads_narrow_gradient`: the update reads a gradient in the
      parameter's dtype with the same result as an fp32 one;
    * `worker`: where an update during the backward pass runs instead of the
      caller's stream (`None`: on the caller's side).
    """

    skip_in_kernel: bool
    copies_gradient: bool
    one_pass: bool = False
    shard_beside_state: bool = False
    reads_narrow_gradient: bool = False
    worker: HostOffload | None = None

    def __init__(self, param: torch.Tensor, group_index: int,
                 layout: StateLayout):
        self.param = param
        self.layout = layout
        # the shard's position among all homes, a salt of its random bits
        # under stochastic rounding (set by `add_group_homes`)
        self.position = 0
        # looked up once: a parameter keeps its shard for life (see the shard's
        # Note: how a parameter finds its shard)
        self.shard: LocalShard | None = LocalShard.of(param)
        self.group_index = group_index

    def gradient(self) -> torch.Tensor | None:
        """The gradient as it is held: the shard's (fp32, or on one rank the
        parameter dtype, see the shard's Note: one rank keeps the parameter
        dtype), or an ordinary parameter's `.grad`; each kernel casts what it
        needs."""
        grad = self.shard.grad if self.shard is not None else None
        return self.param.grad if grad is None else grad

    def read_gradient_once(self, once: bool) -> None:
        """Tell the shard whether its gradient's only reader is an update
        during the backward pass that then frees it (`free_grads`)."""
        if self.shard is not None:
            self.shard.grad_read_once = once and self.reads_narrow_gradient
            self.shard.grad_taken = once

    def free_grad(self) -> None:
        """Drop the gradient: the shard's, and `.grad`."""
        if self.shard is not None:
            self.shard.zero_grad()
        self.param.grad = None

    def first_master(self) -> torch.Tensor | None:
        """The exact fp32 weights the engine kept, taken (once) from the shard."""
        return self.shard.take_master_init() if self.shard is not None else None

    def state_of(self, master: torch.Tensor) -> dict:
        """`step`, `master` and zero moments in the layout's dtypes, in the
        layout's order; a layout without a master keeps only the moments,
        shaped like `master` (then the shard); a per-block state (an 8-bit
        moment's scales) has one value per block."""
        kept = {} if self.layout.master is None else {self.layout.master.name:
                                                      master}
        return {"step": 0, **kept,
                **{t.name: (torch.zeros_like(master, dtype=t.dtype)
                            if t.block is None else
                            master.new_zeros(t.numel(master.numel()), dtype=t.dtype))
                   for t in self.layout.moments}}

    def weight_state(self, weight: torch.Tensor,
                     master: torch.Tensor | None) -> dict:
        """The state of a layout without a master, beside `weight` (the
        tensor the update works on): zero moments, and a compensation of
        what rounding lost of the engine's fp32 `master` where it kept one
        (zero where not)."""
        state = self.state_of(weight)
        compensation = self.layout.compensation
        if compensation is not None and master is not None:
            state[compensation.name] = kahan_summation.compensation_of(
                master, weight)
        return state


class DeviceHome(ShardHome):
    """
    ## Master and moments in the shard's own memory

    An fp32 shard *is* its own master (no copy: $K$ less the master's 4); a
    half-precision one gets an fp32 master of its own. The gradient the update reads
    is the shard's, and the new master is copied into the shard in place.
    """

    copies_gradient = False
    shard_beside_state = True
    # the fused kernel reads a found-inf flag on the device: no host sync
    skip_in_kernel = True
    # the one-pass kernel reads it as it is, the twin casts it (exactly)
    reads_narrow_gradient = True

    @property
    def one_pass(self) -> bool:
        # 8-bit moments take a one pass of their own; a bf16 shard without a
        # master is rounded in one pass of its layout's (stochastically, or
        # beside its compensation)
        if self.layout.blockwise:
            return False
        if self.layout.master is None:
            return self.param.is_cuda and self.param.dtype == torch.bfloat16
        return rounded_update.applies(self.param)

    @property
    def state_device(self) -> torch.device:
        return self.param.device

    def new_state(self) -> dict:
        """`master` [S] fp32 and the moments (layout dtypes) on the shard's
        device."""
        master = self.first_master()
        if self.layout.master is None:
            # no master kept: the engine's fp32 copy is dropped, the shard
            # is the weight (a compensation keeps what rounding lost of it)
            return self.weight_state(self.param.detach(), master)
        if master is None:
            dtype = self.layout.master.dtype
            master = (self.param.data if self.param.dtype == dtype
                      else self.param.detach().to(dtype))
        return self.state_of(master)

    def adopt(self, state: dict) -> None:
        """A loaded state is used as given (an fp32 master may be the shard),
        each state in its layout dtype (a load from another layout converts)."""
        for t in self.layout.tensors:
            if state[t.name].dtype != t.dtype:
                state[t.name] = state[t.name].to(t.dtype)

    def grad_ready(self, grad: torch.Tensor, *, after=None) -> None:
        """Nothing to move: the update reads the gradient where it is."""

    def weight(self) -> torch.Tensor:
        """The weight a layout without a master updates: the shard itself."""
        return self.param.detach()

    @staticmethod
    def found_inf(grad: torch.Tensor) -> torch.Tensor:
        """The non-finite flag of `grad`, on its device, no host sync."""
        return non_finite_flag(grad)

    @staticmethod
    def gradients(homes: list[DeviceHome]) -> list[torch.Tensor | None]:
        return [home.gradient() for home in homes]

    @staticmethod
    def write_back(homes: list[DeviceHome], masters: list[torch.Tensor]) -> None:
        """The rounded masters into the shards, one multi-tensor copy; the next
        all-gather spreads them. An fp32 shard that is its master has nothing
        to copy."""
        pairs = [(h.param, m) for h, m in zip(homes, masters)
                 if m.data_ptr() != h.param.data_ptr()]
        if pairs:
            torch._foreach_copy_([p.data for p, _ in pairs], [m for _, m in pairs])


class HostHome(ShardHome):
    """
    ## Master and moments in host memory

    * `offload`: the copy streams and worker all host homes share.
    * `staging`: this shard's `HostShard`, the buffer its gradient comes down
      into and its rounded master goes up from.

    The master never aliases the shard, also for an fp32 shard on CPU.

    ### Note: a host home without a master

    A layout without a master (`"bf16-stochastic"`, `"bf16-kahan"`) updates
    the weight itself, and the weight is the shard, in device memory. The
    host cannot update what it does not hold, so the home keeps
    `host_weight`, a copy of the shard in host memory ($p$ bytes an element,
    the same values). The update is the device's, run eagerly on the
    host's copy: the gradient comes down as for a master, the same
    `stochastic_rounding.update` or `kahan_summation.update` runs on
    `host_weight` and the states beside it, and `write_back` sends
    `host_weight` up into the shard, as it sends a master's rounding. Every
    input is the same (the noise hashes the shard's position and the step,
    wherever it runs), so the result is the device update's bit for bit
    (tested: tests/optimizers/test_offload_no_master.py::test_no_master_offload_is_bitwise).

    Copying the shard down with each gradient would save the $p S$ host
    bytes for $p S$ more down a step; the copy is kept instead, since the
    shard changes only by this update. It is not a state: a checkpoint
    saves the shard as the weight, once, and a load (`adopt`) or a fresh
    state (`new_state`) takes the copy from the shard again, so it never
    outlives the shard it copies. A weight written into the shard by other
    means than a checkpoint load must be followed by `refresh_weight`.
    """

    copies_gradient = True
    # the host update reads its flag on the host, where that is free (the
    # flag came down with the gradient)
    skip_in_kernel = False

    def __init__(self, param: torch.Tensor, group_index: int,
                 layout: StateLayout, *, offload: HostOffload):
        super().__init__(param, group_index, layout)
        self.offload = offload
        self.worker = offload if offload.worker is not None else None
        # pinned only where a DMA engine will read or write it
        self.staging = HostShard(param, pin=grad_device(param).type == "cuda")

    state_device = torch.device("cpu")

    def new_state(self) -> dict:
        """`master` [S] fp32 and both moments on the host; `copy=True`: on CPU
        an fp32 shard is already there, and its master must be its own.
        Without a master, the host copy of the weight (see Note: a host home
        without a master) and the states beside it."""
        master = self.first_master()
        if self.layout.master is None:
            self.refresh_weight()
            return self.weight_state(self.host_weight, master)
        if master is None:
            master = self.param.detach()
        dtype = self.layout.master.dtype
        return self.state_of(master.to("cpu", dtype, copy=True))

    def refresh_weight(self) -> None:
        """The host copy of the weight, from the shard: `[S]` in the shard's
        dtype, in host memory of its own."""
        self.host_weight = self.param.detach().to("cpu", copy=True)

    def weight(self) -> torch.Tensor:
        """The weight a layout without a master updates: the host copy."""
        return self.host_weight

    def adopt(self, state: dict) -> None:
        """A state loaded onto the device (an fp32 shard's master as the shard
        itself) is copied home, so the device memory is freed and the master
        does not alias the shard; each in its layout dtype. Without a master
        the host copy of the weight is taken again from the shard, which
        the checkpoint has just loaded."""
        for spec in self.layout.tensors:
            t = state[spec.name]
            if (t.device.type != "cpu" or t.dtype != spec.dtype
                    or t.data_ptr() == self.param.data_ptr()):
                state[spec.name] = t.to("cpu", spec.dtype, copy=True)
        if self.layout.master is None:
            self.refresh_weight()

    def grad_ready(self, grad: torch.Tensor, *, after=None) -> None:
        """Start the copy down as soon as `after` (the reduce stream) wrote it."""
        self.offload.copy_down(self.staging, grad, after=after)

    def found_inf(self, grad: torch.Tensor) -> torch.Tensor:
        """The flag that came down with the host copy `grad` (after
        `gradients`, which waits for both)."""
        assert grad is self.staging.staging, "the flag of the host copy only"
        return self.staging.found_inf

    @staticmethod
    def gradients(homes: list[HostHome]) -> list[torch.Tensor]:
        """The host copies, each once its copy down has landed."""
        return [h.offload.host_grad(h.staging, h.gradient()) for h in homes]

    @staticmethod
    def write_back(homes: list[HostHome], masters: list[torch.Tensor]) -> None:
        """Round each master on the host and send it up (`HostOffload.upload`);
        a shard the engine keeps in host memory is rounded into directly, and
        its next gather copies it up."""
        for home, master in zip(homes, masters):
            if home.shard is not None and home.shard.on_host:
                home.param.data.copy_(master)
            else:
                home.offload.upload(home.staging, home.param, master)


class Homes(NamedTuple):
    """
    ## Every shard's home, and the kernels' batches, built once

    * `of`: each parameter's home.
    * `device_batches`: the device homes, one list per (param group, device,
      dtype): one multi-tensor kernel launch each (per step count).
    * `host`: the host homes in parameter order; each is updated alone, so
      its copy up starts as soon as its update ends.
    * `offload`: the streams and worker the host homes share.
    * `layout`: the states every home allocates.
    """

    of: dict[torch.Tensor, ShardHome]
    device_batches: list[list[DeviceHome]]
    host: list[HostHome]
    offload: HostOffload
    layout: StateLayout


def build_homes(param_groups: list[dict], offloaded: Iterable[torch.Tensor], *,
                worker: bool, layout: StateLayout) -> Homes:
    """
    ### One home per parameter, the offloaded ones on the host

    `AdamFP16` calls this once, at construction, the `offload=` positions
    deciding which kind; every later question about a shard (where its state
    is allocated, which gradient the update reads, whether the fused kernel may
    skip a non-finite gradient on the device, how the new master reaches the
    shard) is a call on its home. The device homes are grouped here for the
    multi-tensor kernels, once. A param group added later (`add_param_group`)
    keeps its state on the device.

    `worker`: whether host updates may run during the backward pass (on the
    offload's worker thread).
    """
    offloaded = set(offloaded)
    gpus = {d for d in map(grad_device, offloaded) if d.type == "cuda"}
    offload = HostOffload(gpus, worker=worker and bool(offloaded))
    homes = Homes({}, [], [], offload, layout)
    for index, group in enumerate(param_groups):
        add_group_homes(homes, index, group, offloaded)
    return homes


def add_group_homes(homes: Homes, index: int, group: dict,
                    offloaded: set[torch.Tensor]) -> None:
    """#### The homes of one param group, its device homes batched"""
    batches: dict[tuple, list[DeviceHome]] = {}
    for param in group["params"]:
        if param in offloaded:
            home = HostHome(param, index, homes.layout, offload=homes.offload)
            homes.host.append(home)
        else:
            home = DeviceHome(param, index, homes.layout)
            batches.setdefault((param.device, param.dtype), []).append(home)
        home.position = len(homes.of)
        homes.of[param] = home
    homes.device_batches.extend(batches.values())
