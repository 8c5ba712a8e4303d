"""`finetune/token_file.py`: the token file decided once by the launcher (its
key, the room it needs, its older files pruned), checked by the ranks against
the data as it was, and a preparation that a full disk or a signal stops in one
line, leaving no file."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from labml_zero.finetune import token_file
from labml_zero.finetune.corpus import DataError
from labml_zero.finetune.dataset import load_datasets, load_text
from labml_zero.finetune.token_file import open_cache, prepare_token_file
from labml_zero.neox.tokenizer import encode, end_of_text_id

REPO = Path(__file__).resolve().parent.parent.parent


def prepare(path, tokenizer):
    return prepare_token_file(path, tokenizer, eot=end_of_text_id(tokenizer))


def rewrite_keeping_size_and_time(path: Path, text: str) -> None:
    before = path.stat()
    assert len(text.encode()) == before.st_size
    path.write_text(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns


def caches_of(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f".{name}.*.tokens.u16"))


def test_the_key_sees_a_rewrite_and_the_old_file_is_pruned(tokenizer, tmp_path):
    data, other = tmp_path / "c.txt", tmp_path / "other.txt"
    data.write_text("The first text, of one line.")
    other.write_text("Another corpus, whose file stays.")
    eot = end_of_text_id(tokenizer)
    first, kept = prepare(data, tokenizer), prepare(other, tokenizer)
    (tmp_path / ".c.txt.notes").write_text("not the builder's")
    rewrite_keeping_size_and_time(data, "The other text, of one line!")
    second = prepare(data, tokenizer)
    assert second.key != first.key
    assert open_cache(second, vocab=1 << 16).tolist() == [
        *encode(tokenizer, data.read_text()), eot]
    # this path's older file went; another path's and a stranger's stayed
    assert caches_of(tmp_path, "c.txt") == [second.path]
    assert kept.path.is_file() and (tmp_path / ".c.txt.notes").is_file()
    # touching the file changes no content: the same key, nothing rebuilt
    os.utime(data, (1, 1))
    assert prepare(data, tokenizer).key == second.key


@pytest.mark.parametrize("change, message", [
    (lambda p: p.write_text(p.read_text()[:-5]), "bytes then,"),
    (lambda p: os.utime(p, (1, 1)), "its modification time differs"),
    (lambda p: rewrite_keeping_size_and_time(p, p.read_text().upper()),
     "same size and time, other content"),
    (lambda p: p.unlink(), "it is gone"),
])
def test_a_rank_refuses_data_changed_after_the_launcher(tokenizer, tmp_path,
                                                        monkeypatch, change,
                                                        message):
    data = tmp_path / "c.txt"
    data.write_text(load_text()[:20_000])
    splits = load_datasets(seq_len=16, source=data, tokenizer=tokenizer,
                           eot=end_of_text_id(tokenizer))
    (cache,) = splits.caches
    # a rank given the launcher's decision maps it and tokenises nothing
    monkeypatch.setattr(token_file, "build_token_file", None)
    again = load_datasets(seq_len=16, source=data, tokenizer=tokenizer,
                          eot=end_of_text_id(tokenizer), caches=splits.caches)
    assert np.array_equal(again.train.tokens, splits.train.tokens)
    change(data)
    with pytest.raises(DataError) as refused:
        load_datasets(seq_len=16, source=data, tokenizer=tokenizer,
                      eot=end_of_text_id(tokenizer), caches=splits.caches)
    line = str(refused.value)
    assert "\n" not in line and str(data) in line and message in line
    assert "changed since the launcher read it" in line
    assert cache.path.is_file()


def test_a_disk_without_room_is_refused_before_writing(tokenizer, tmp_path,
                                                       monkeypatch):
    data = tmp_path / "c.txt"
    data.write_text("Some text to tokenise. " * 100)
    # up to one token a byte, plus the end-of-text token, two bytes each
    need = (data.stat().st_size + 1) * 2
    usage = shutil.disk_usage(tmp_path)._replace(free=need - 1)
    monkeypatch.setattr(token_file.shutil, "disk_usage", lambda path: usage)
    with pytest.raises(DataError) as refused:
        prepare(data, tokenizer)
    line = str(refused.value)
    assert "\n" not in line and ".tokens.u16 needs up to" in line
    assert f"({1e-6:,.1f} MB short)" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]
    monkeypatch.setattr(token_file.shutil, "disk_usage",
                        lambda path: usage._replace(free=need))
    assert prepare(data, tokenizer).path.is_file()


def test_a_disk_that_fills_while_writing_leaves_no_file(tokenizer, tmp_path,
                                                        monkeypatch):
    data = tmp_path / "c.txt"
    data.write_text(load_text()[:300_000])
    writes = []

    def full_after_one(f, ids):
        if writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        writes.append(len(ids))
        f.write(ids.data)

    monkeypatch.setattr(token_file, "write_ids", full_after_one)
    with pytest.raises(DataError) as refused:
        prepare(data, tokenizer)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(str(tmp_path / ".c.txt."))
    assert f"cannot write the token file after {writes[0] * 2 / 1e6:,.1f} MB " \
           f"({os.strerror(errno.ENOSPC)})" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt"]


def words_file(path: Path, mb: int) -> None:
    """`mb` MB of varied text: tokenising it takes seconds, not milliseconds."""
    rng = np.random.default_rng(0)
    words = load_text().split()
    with open(path, "w") as f:
        for _ in range(mb):
            f.write(" ".join(rng.choice(words, size=180_000)) + "\n")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_tokenising_is_one_line_and_no_file(tmp_path, signum):
    data = tmp_path / "data"
    data.mkdir()
    words_file(data / "big.txt", 8)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # On a loaded machine the signal can land just after the build ended (the
    # token file renamed into place), while the ranks start: it must still end
    # the job, but that run tests nothing about the build, so it is run again,
    # at most twice.
    for attempt in range(3):
        process = subprocess.Popen(
            [sys.executable, "-m", "labml_zero.finetune_neox", "--world-size", "1",
             "--data", str(data / "big.txt"), "--out", str(tmp_path / f"out{attempt}"),
             "--log-dir", str(tmp_path / f"logs{attempt}")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        # the token file's temporary sibling: the build has started
        while not any(".tmp-" in p.name for p in data.iterdir()):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
        assert process.returncode == 128 + signum, err
        built = [p for p in data.iterdir() if p.name != "big.txt"]
        if not (built and not any(".tmp-" in p.name for p in built)):
            break
        for p in built:  # this test's own token file, written by its own run
            p.unlink()
    assert err == "python -m labml_zero.finetune_neox: interrupted\n"
    assert sorted(p.name for p in data.iterdir()) == ["big.txt"]


def changed_after_the_checks(tmp_path, monkeypatch, capsys, data, change) -> str:
    """Run the job on `data`, calling `change()` after the launcher's checks
    and before the rank starts; the rank's one line of error."""
    from labml_zero.finetune import cli

    checks = cli.check_before_start

    def then_change(*args, **kwargs):
        checked = checks(*args, **kwargs)
        change()
        return checked

    monkeypatch.setattr(cli, "check_before_start", then_change)
    monkeypatch.setattr(cli.launch, "default_backend", lambda: "gloo")
    status = cli.main(["--world-size", "1", "--batch-size", "2", "--seq-len",
                       "16", "--steps", "1", "--data", str(data), "--out",
                       str(tmp_path / "out"), "--log-dir", str(tmp_path / "logs")])
    err = capsys.readouterr().err
    assert status == 1
    assert err.count("\n") == 1, err
    return err


def test_a_rank_stops_in_one_line_when_the_data_changed(tmp_path, monkeypatch,
                                                       capsys):
    data = tmp_path / "c.txt"
    data.write_text(load_text()[:20_000])
    err = changed_after_the_checks(tmp_path, monkeypatch, capsys, data,
                                   lambda: data.write_text(load_text()[:10_000]))
    assert f"--data {data}: changed since the launcher read it" in err


def test_a_token_file_rewritten_after_its_check_stops_the_rank(tmp_path,
                                                               monkeypatch, capsys):
    """A pre-tokenised file's ids are scanned by the launcher alone; one
    rewritten afterwards with ids past the vocabulary would reach the ranks
    unscanned, so they check its stamp as they do a text file's."""
    data = tmp_path / "c.u16"
    np.arange(2000, dtype=np.uint16).tofile(data)
    err = changed_after_the_checks(
        tmp_path, monkeypatch, capsys, data,
        lambda: np.full(2000, 65000, dtype=np.uint16).tofile(data))
    assert f"--data {data}: changed since the launcher read it" in err


# A process of a torchrun host: it prepares `data`, writing `looked` to `log` as
# it decides where the token file is and `built` as it starts building it. A
# builder waits until all `n` processes have looked, so without the lock each
# of them would find the file missing and build it.
RACER = r"""
import sys, time
from pathlib import Path
from labml_zero.finetune import token_file
from labml_zero.neox.tokenizer import end_of_text_id, load_tokenizer

data, log, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
decide, build = token_file.cache_path, token_file.build_token_file

def write(line):
    with open(log, "a") as f:
        f.write(line + "\n")

def looked(*args, **kwargs):
    write("looked")
    return decide(*args, **kwargs)

def built(*args, **kwargs):
    write("built")
    deadline = time.monotonic() + 60
    while log.read_text().count("looked") < n and time.monotonic() < deadline:
        time.sleep(0.01)
    if sys.argv[4:] == ["hold"]:  # the builder that is killed while holding it
        time.sleep(600)
    return build(*args, **kwargs)

token_file.cache_path, token_file.build_token_file = looked, built
tokenizer = load_tokenizer()
cache = token_file.prepare_token_file(data, tokenizer,
                                      eot=end_of_text_id(tokenizer))
print(cache.path, cache.key)
"""


def racers(data: Path, log: Path, n: int, *extra: str) -> list[subprocess.Popen]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return [subprocess.Popen([sys.executable, "-c", RACER, str(data), str(log),
                              str(n), *extra], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for _ in range(n)]


def test_processes_of_one_host_build_the_token_file_once(tokenizer, tmp_path):
    (tmp_path / "data").mkdir()
    data, log = tmp_path / "data" / "c.txt", tmp_path / "log"
    data.write_text(load_text()[:20_000])
    outs = []
    for process in racers(data, log, 3):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        outs.append(out.splitlines()[-1])
    # one build; every process got the same file and key
    assert log.read_text().count("built") == 1
    assert len(set(outs)) == 1
    path = Path(outs[0].split()[0])
    assert np.fromfile(path, dtype=np.uint16).tolist() == [
        *encode(tokenizer, data.read_text()), end_of_text_id(tokenizer)]
    # no lock file left behind: the data and its token file alone
    assert sorted(data.parent.iterdir()) == sorted([data, path])


def test_a_builder_killed_holding_the_lock_blocks_no_one(tokenizer, tmp_path):
    (tmp_path / "data").mkdir()
    data, log = tmp_path / "data" / "c.txt", tmp_path / "log"
    data.write_text(load_text()[:20_000])
    (holder,) = racers(data, log, 1, "hold")
    deadline = time.monotonic() + 60
    while not (log.is_file() and "built" in log.read_text()):
        assert holder.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    lock = token_file.lock_path(data)
    assert lock.is_file()
    holder.kill()
    holder.communicate(timeout=60)
    # the kernel released the lock; its name is reused, then removed
    cache = prepare(data, tokenizer)
    assert open_cache(cache, vocab=1 << 16).tolist() == [
        *encode(tokenizer, data.read_text()), end_of_text_id(tokenizer)]
    assert sorted(data.parent.iterdir()) == sorted([data, cache.path])


def test_a_waiter_locks_the_name_not_the_file_removed_under_it(tmp_path,
                                                               monkeypatch):
    # flock locks an open file, so two descriptors of one process contend as two
    # processes would; the holder removes the name while a waiter is blocked
    data = tmp_path / "c.txt"
    data.write_text("text")
    flock, blocking, entered, done = (fcntl.flock, threading.Event(),
                                      threading.Event(), threading.Event())

    def watched(fd, operation):
        if not operation & fcntl.LOCK_NB:
            blocking.set()
        return flock(fd, operation)

    def waiter():
        with token_file.build_lock(data):
            entered.set()
            done.wait(60)

    monkeypatch.setattr(token_file.fcntl, "flock", watched)
    with token_file.build_lock(data):
        thread = threading.Thread(target=waiter)
        thread.start()
        assert blocking.wait(60)
    assert entered.wait(60)
    # the waiter holds the lock under the name: a newcomer cannot take it
    probe = os.open(token_file.lock_path(data), os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(BlockingIOError):
            flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(probe)
        done.set()
        thread.join(60)
    assert sorted(tmp_path.iterdir()) == [data]


def test_a_lock_that_cannot_be_opened_is_one_line(tokenizer, tmp_path):
    data = tmp_path / "c.txt"
    data.write_text("text")
    token_file.lock_path(data).mkdir()  # a directory cannot be locked as a file
    with pytest.raises(DataError) as refused:
        prepare(data, tokenizer)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"--data {data}: cannot open its token file's lock")
    assert os.strerror(errno.EISDIR) in line
    assert not caches_of(tmp_path, "c.txt")
