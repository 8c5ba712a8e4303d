r"""
---
title: Optimizers for sharded mixed-precision training
summary: fp32 master weights and Adam moments on each rank's shards.
---

# Optimizers for sharded mixed-precision training

With bf16 parameters an update below half a unit in the last place of a weight
is lost (bf16 keeps 8 bits of mantissa), so mixed-precision training keeps an
fp32 *master* copy of the weights, updates it, and writes the rounded result
back to the bf16 copy the computation uses. Adam's master and two moments are
$K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes a parameter, against 2 for the bf16 parameter and 4 for its fp32
gradient: $\frac{K}{2 + 4 + K} = \frac{2}{3}$ of the model states, which is
why ZeRO shards the optimizer state first. Under ZeRO-3 each rank holds these
for its own [shards](../zero3/shard.html) only. The other choices of
[state layout](../zero3/state_layout.html) keep fewer bytes: narrower
moments beside the fp32 master, or no master at all, the bf16 weight
rounded stochastically or kept with a bf16 compensation.
"""
