"""`bench.eightbit_update`: its refusals, and its two paths on a CPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from bench import eightbit_update as E
from tests import tolerance


def test_it_refuses_without_cuda(capsys):
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        with pytest.raises(SystemExit, match="^bench.eightbit_update times "
                                             "CUDA kernels: no GPU here$"):
            E.main(["--numel", "1000"])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv,message", [
    (["--numel", "1.5"], "--numel must be a whole number of elements >= 1, "
                         "got 1.5"),
    (["--numel", "0"], "--numel must be a whole number of elements >= 1, got 0"),
    (["--repeat", "0"], "--repeat must be >= 1, got 0")])
def test_it_refuses_bad_arguments_in_one_line(argv, message):
    with pytest.raises(SystemExit, match=f"^bench.eightbit_update: {message}$"):
        E.main(argv)


def test_its_two_paths_agree_after_a_step_from_the_same_state():
    """The twin and the one pass as the bench runs them (here on a CPU, the
    one pass eagerly): one step apart within an update's roundings."""
    n = 3 * 256 + 17
    master = torch.randn(n, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 1e-3
    optimizer = E.AdamFP16([torch.nn.Parameter(torch.zeros(1))], **E.HYPER,
                           fused=True)
    ours = E.new_state(master)
    E.one_pass_step(ours, grad, 1)
    theirs = {k: v.clone() for k, v in ours.items()}
    E.one_pass_step(ours, grad, 2)
    E.twin_step(optimizer)(theirs, grad, 2)
    agreement = E.agreement(ours, theirs)
    one_step = tolerance.parity(torch.float32, terms=tolerance.ADAMW_ROUNDINGS)
    assert tolerance.within(ours["master"], theirs["master"], one_step)
    assert agreement["exp_avg_codes_max_diff"] <= 1
    assert agreement["exp_avg_sq_codes_max_diff"] <= 1
