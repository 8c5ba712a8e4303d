"""The host tools of the benchmark run end to end on a CPU."""

import pytest

from bench import host_profile, host_speed


def test_host_speed_times_five_loops():
    times = host_speed.main()
    assert len(times) == 5 and all(t > 0 for t in times)


@pytest.mark.distributed
def test_host_profile_writes_its_table(tmp_path):
    out = tmp_path / "profile.txt"
    host_profile.main(["--tiny", "--workload", "W4", "--steps", "2",
                       "--out", str(out)])
    text = out.read_text()
    first = text.splitlines()[0]
    assert first.startswith("W4 labml_zero kernels=none compiled=False: host per step")
    assert "Python calls per step" in first
    assert "hooks.py" in text  # the engine's hooks are among the profiled calls


def test_host_profile_refuses_no_steps():
    with pytest.raises(SystemExit, match="--steps"):
        host_profile.main(["--steps", "0"])
