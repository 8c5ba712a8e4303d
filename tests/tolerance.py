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
* **A chain of sums** (a forward and backward pass: `chained` reductions of at
  most `n` terms along the path of a value): to first order the relative
  errors add, $\rho = \gamma_{c n}$.
* **A value** (a loss, a logit, a gradient): `rtol` $= \rho$, and `atol`
  $= \rho \cdot$ `scale`, where `scale` is the size of the terms, for values
  that cancel to near zero.
* **After $k$ AdamW steps at learning rate $\eta$**: an update
  $\eta\,\hat m / (\sqrt{\hat v} + \epsilon)$ does not change when every
  gradient is scaled, so a relative gradient error $\rho$ moves it by about
  $\eta \rho$; $k$ updates add, `atol` $= k \eta \rho$, and the parameter's own
  rounding, once a step, gives `rtol` $= k u$.

The bound must stay small enough to catch a real bug: `tests/test_tolerance.py`
checks that an update with the learning rate $\times 1.001$, or without its
weight decay, fails the same tolerance a correct one passes.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """$u = \\epsilon / 2$: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def sum_error(dtype: torch.dtype, terms: int) -> float:
    """$\\gamma_n$: relative error of a sum of `terms` terms in any order."""
    nu = terms * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{terms} terms in {dtype} carry no correct digit")
    return nu / (1 - nu)


def parity(dtype: torch.dtype, *, n: int, chained: int = 1, steps: int = 0,
           lr: float = 0.0, scale: float = 1.0) -> dict[str, float]:
    """`rtol` and `atol` for `torch.testing.assert_close` (see the rule above).

    * `n`: the longest reduction (a matmul's inner size, a sum over tokens).
    * `chained`: how many reductions lie on the path of one compared value.
    * `steps`, `lr`: AdamW steps between the two programs' common start and the
      compared parameters; 0 for a value of one pass.
    * `scale`: the size of the terms of a value that may cancel to near zero.
    """
    rho = sum_error(dtype, chained * n)
    if steps == 0:
        return {"rtol": rho, "atol": rho * scale}
    return {"rtol": steps * unit_roundoff(dtype), "atol": steps * lr * rho}


def neox_chained(n_layers: int, *, backward: bool) -> int:
    """Reductions on a value's path through a GPT-NeoX of `n_layers` layers.

    Each layer chains 6 matmuls (query-key-value, scores, values, dense, the
    MLP's two) and 2 layer norms; the final norm, the head and the loss add 3.
    The backward pass chains as many again.
    """
    forward = 8 * n_layers + 3
    return 2 * forward if backward else forward


def within(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict) -> bool:
    """`assert_close`'s test as a boolean: $|a - e| \\le$ atol $+$ rtol $|e|$."""
    bound = tolerance["atol"] + tolerance["rtol"] * expected.abs()
    return bool(((actual - expected).abs() <= bound).all())
