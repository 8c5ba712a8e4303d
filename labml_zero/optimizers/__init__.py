r"""
---
title: Optimizers for sharded mixed-precision training
summary: fp32 master weights and Adam moments on each rank's shards.
---

# Optimizers for sharded mixed-precision training

With 16-bit parameters, an update smaller than half a unit in the last place of the
weight is lost: bf16 keeps 8 bits of mantissa, so a weight of $1$ ignores any
update below $2^{-8}$. Mixed-precision training therefore keeps an fp32 *master*
copy of the weights, applies the updates to it, and writes the rounded result back
to the 16-bit copy that the computation uses. With Adam the optimizer holds, per
parameter, the master (4 bytes) and two moments (4 + 4 bytes): $K = 12$ bytes,
against 2 for the 16-bit parameter and 4 for its fp32 gradient shard. That $K$
is why ZeRO shards the optimizer state first: it is

$$\frac{K}{2 + 4 + K} = \frac{12}{18}$$

(tested: tests/zero3/test_memory_model.py::test_figures_in_the_memory_notes)

of the model states here ($\frac{12}{16}$ in the paper, which counts a 16-bit
gradient).

Under ZeRO-3 each rank holds these for its own shards only: the optimizer sees one
flat 16-bit tensor per trainable chunk, with its fp32 gradient in `main_grad`.

The pages follow in reading order: [AdamFP16](adam_fp16.html), the optimizer,
then the training features that act on the shards' gradients: the global
gradient norm for clipping (one all-reduce over the shards) and fp16's dynamic
loss scale, whose overflow all ranks agree on.
"""
