r"""How far two correct programs may differ: the one rule of the parity tests.

Two correct programs that compute the same value in floating point differ only
in the order of their roundings (a sharded sum adds its terms in another order,
and a CPU's matmul kernel picks its own blocking). The parity tests compare
such programs, so each tolerance is this bound, computed from the dtype, the
sizes and the number of steps, never a constant that happened to pass:

* **One sum.** $n$ terms in any order are within $\gamma_n \sum |x_i|$ of the
  exact sum, with $\gamma_n = n u / (1 - n u)$ and $u$ the dtype's unit
  roundoff, $\epsilon / 2$ (Higham, *Accuracy and Stability of Numerical
  Algorithms*, Lemma 3.1 and eq. 3.5). This is the worst case over all orders,
  so no kernel's choice breaks it.
* **A chain of sums** (a forward and backward pass): the relative errors of
  the reductions on a value's path add, to first order, and
  $\gamma_a + \gamma_b \le \gamma_{a+b}$, so $\rho = \gamma_T$ with $T$ =
  `terms`, the sum of the lengths of those reductions (a matmul with inner
  size $d$ adds $d$; a layer norm of width $d$ adds $d$).
* **A value** (a loss, a logit, a gradient): `rtol` $= \rho$, and `atol`
  $= \rho \cdot$ `scale`, where `scale` is the size of the terms, for values
  that cancel to near zero.
* **A loss after $k$ AdamW steps**: each update, off by a fraction $\rho$ of
  itself, moves the loss by at most $\rho$ times the step's change of the
  loss, which is smaller than the loss: `rtol` $= (k + 1)\rho$.
* **Parameters after $k$ AdamW steps at learning rate $\eta$**: an update
  $\eta\,\hat m / (\sqrt{\hat v} + \epsilon)$ does not change when every
  gradient is scaled, so a relative gradient error $\rho$ moves it by about
  $\eta \rho$; $k$ updates add, `atol` $= k \eta \rho$, and the parameter's own
  rounding, once a step, gives `rtol` $= k u$.

The bound must stay small enough to catch a real bug: an update with the
learning rate $\times 1.001$, or without its weight decay, fails the same
tolerance a correct one passes (`tests/optimizers/test_adam_fp16.py::
test_fp32_update_equals_adamw`, `tests/neox/test_lora.py::
test_parity_with_plain_lora_and_adamw`); and the bound holds for sums in
orders a kernel may choose (`tests/test_tolerance.py`).
"""

from __future__ import annotations

import torch


# An AdamW update rounds about this many times on its own (two ops for each
# moment, the two bias corrections, the square root, the epsilon, the
# division, the decay and the step): `terms` where two programs feed the same
# gradients to two kernels of the update.
ADAMW_ROUNDINGS = 10


def unit_roundoff(dtype: torch.dtype) -> float:
    """$u = \\epsilon / 2$: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def sum_error(dtype: torch.dtype, terms: int) -> float:
    """$\\gamma_n$: relative error of a sum of `terms` terms in any order."""
    nu = terms * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{terms} terms in {dtype} carry no correct digit")
    return nu / (1 - nu)


def parity(dtype: torch.dtype, *, terms: int, steps: int = 0, lr: float = 0.0,
           scale: float = 1.0) -> dict[str, float]:
    """`rtol` and `atol` for `torch.testing.assert_close` (see the rule above).

    * `terms`: the sum of the lengths of the reductions on one value's path.
    * `steps`, `lr`: AdamW steps between the two programs' common start and the
      compared parameters; 0 for a value of one pass.
    * `scale`: the size of the terms of a value that may cancel to near zero.
    """
    rho = sum_error(dtype, terms)
    if steps == 0:
        return {"rtol": rho, "atol": rho * scale}
    return {"rtol": steps * unit_roundoff(dtype), "atol": steps * lr * rho}


def neox_terms(config, *, seq: int, tokens: int = 0, backward: bool = False,
               vocab: bool = True) -> int:
    """`terms` of a value's path through a GPT-NeoX `config` (a `NeoXConfig`)
    for sequences of `seq` tokens: to the logits, or with `tokens` > 0 (the
    batch's) to the loss over them.

    Each layer reduces over $d$ in its query-key-value, dense and MLP-up
    matmuls and its 2 layer norms, over the head size in the scores, over the
    sequence in the values and over $d_{ff}$ in the MLP's down projection:
    $6d + d_h + T + d_{ff}$ with $T$ = `seq`; the final norm and
    the head add $2d$, the loss $V$ + `tokens`. The backward pass runs the same
    reductions in reverse and sums each weight's gradient over the tokens.
    `vocab=False` leaves out the loss's sum over the vocabulary, for two runs
    of one engine that only batch their rows differently: a row's softmax
    is summed by the same row kernel whatever the number of rows.
    """
    d, d_head = config.d_model, config.d_model // config.n_heads
    layer = 6 * d + d_head + seq + config.ff_dim
    forward = config.n_layers * layer + 2 * d
    if tokens:
        forward += tokens + (config.n_vocab if vocab else 0)
    return 2 * forward + tokens if backward else forward


def loss_after(dtype: torch.dtype, *, terms: int, steps: int) -> dict[str, float]:
    """`rel` and `abs` for `pytest.approx` of a loss after `steps` AdamW steps
    (see the rule above); `abs` for a loss near zero, at the size of one."""
    rho = (steps + 1) * sum_error(dtype, terms)
    return {"rel": rho, "abs": rho}


def max_error(tolerance: dict, magnitude: float = 1.0) -> float:
    r"""The largest $|a - e|$ the tolerance allows for values $|e| \le$ `magnitude`,
    for reports that carry only their largest difference."""
    return tolerance["atol"] + tolerance["rtol"] * magnitude


def within(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict) -> bool:
    """`assert_close`'s test as a boolean: $|a - e| \\le$ atol $+$ rtol $|e|$."""
    bound = tolerance["atol"] + tolerance["rtol"] * expected.abs()
    return bool(((actual - expected).abs() <= bound).all())
