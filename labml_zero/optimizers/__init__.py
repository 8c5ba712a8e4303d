r"""
---
title: Optimizers for sharded mixed-precision training
summary: fp32 master weights and Adam moments on each rank's shards.
---

# Optimizers for sharded mixed-precision training

With bf16 parameters, an update smaller than half a unit in the last place of the
weight is lost: bf16 keeps 8 bits of mantissa, so a weight of $1$ ignores any
update below $2^{-8}$. Mixed-precision training therefore keeps an fp32 *master*
copy of the weights, applies the updates to it, and writes the rounded result back
to the bf16 copy that the computation uses. With Adam the optimizer holds, per
parameter, the master (4 bytes) and two moments (4 + 4 bytes): $K = 12$
(tested: tests/zero3/test_memory_and_comm.py::test_memory_per_rank_and_bytes_per_step)
bytes, against 2 for the bf16 parameter and 4 for its fp32 gradient shard. That $K$
is why ZeRO shards the optimizer state first: it is

$$\frac{K}{2 + 4 + K} = \frac{2}{3}$$

of the model states here, and $\frac{3}{4}$ in the paper, which counts a
half-precision gradient. The [state layout](../zero3/state_layout.html)
declares these states, and other choices.

Under ZeRO-3 each rank holds these for its own shards only: the optimizer sees one
flat bf16 tensor per trainable chunk, with its fp32 gradient in its
[shard](../zero3/shard.html).

The pages follow below in reading order: the optimizer, its state layout,
where each shard's state lives, the update's kernels (bf16 and 8-bit moments and
stochastic rounding among them), the training features that act on the
shards' gradients (clipping's global norm, fp16's loss scale), and last the
whole step as one CUDA graph.
"""
