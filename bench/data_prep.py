"""Benchmark of the fine-tune's data preparation (not a test; timings are noisy).

    python -m bench.data_prep --shape text --mb 200 --dir /tmp/data-bench
    python -m bench.data_prep --shape one-line --mb 200
    python -m bench.data_prep --shape record --mb 60

1. writes a corpus of `--mb` MB of Tiny Shakespeare's paragraphs, repeated and
   shuffled (seeded), in one of three shapes: `text` (its own line breaks),
   `one-line` (no line break at all) or `record` (one JSON Lines record);
2. in a fresh process, builds its token file with `corpus_tokens` and reports
   the time, MB/s and that process's peak resident memory (VmHWM), the
   interpreter and the tokenizer included;
3. times a BLAKE2b digest of the corpus in 1 MiB blocks (what the key costs);
4. for `text` and this checkout's builder, also: the tokenizer called one
   piece at a time on a part of it,
   the second run's preparation (the cached file opened again), and, in a
   fresh process, a rank's reads from the memory-mapped token file.

`--root` runs the builder from another checkout (`--root /work/main` measures
the code there), so before and after are one command each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from labml_zero.finetune.corpus import find_sources, read_documents
from labml_zero.finetune.dataset import load_text
from labml_zero.finetune.token_file import corpus_tokens
from labml_zero.neox.tokenizer import end_of_text_id, load_tokenizer

# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across exec
STATUS = """
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**10
"""
BUILDER = STATUS + """
import sys, time
from labml_zero.finetune.token_file import corpus_tokens
from labml_zero.neox.tokenizer import end_of_text_id, load_tokenizer
tokenizer = load_tokenizer()
before = status("VmHWM")
start = time.perf_counter()
tokens = corpus_tokens(sys.argv[1], tokenizer, eot=end_of_text_id(tokenizer))
print(time.perf_counter() - start, len(tokens), before, status("VmHWM"))
"""
READER = STATUS + """
import sys, numpy as np, torch
from labml_zero.finetune.dataset import TextDataset
tokens = np.memmap(sys.argv[1], dtype=np.uint16, mode="r")
before = status("RssAnon")
ds = TextDataset(tokens, seq_len=512)
rng = np.random.default_rng(0)
for _ in range(2000):
    ds.batch(rng.integers(0, len(ds), 8).tolist())
# anonymous memory is the loader's own; file pages are the page cache's,
# shared by the ranks and dropped under pressure
print(before, status("RssAnon"), status("RssFile"), status("VmHWM"))
"""


def write_corpus(path: Path, mb: int, shape: str) -> None:
    paragraphs = load_text().split("\n\n")
    if shape != "text":
        paragraphs = [p.replace("\n", " ") for p in paragraphs]
    rng = np.random.default_rng(0)
    sep = "\n\n" if shape == "text" else " "
    written = 0
    with open(path, "w") as f:
        if shape == "record":
            f.write('{"text": "')
        while written < mb * 1e6:
            # one pass is about 1.1 MB; stop at the size asked for
            for i in rng.permutation(len(paragraphs)):
                part = paragraphs[i] + sep
                f.write(json.dumps(part)[1:-1] if shape == "record" else part)
                written += len(part)
        if shape == "record":
            f.write('"}\n')


def run(code: str, root: Path, *args: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    # in `root`: `-c` puts the working directory first on the path
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=root,
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"the child failed: {done.stderr.strip().splitlines()[-1]}")
    # the last line: the builder prints its summary before it
    return [float(x) for x in done.stdout.strip().splitlines()[-1].split()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--shape", choices=("text", "one-line", "record"),
                   default="text")
    p.add_argument("--dir", default="/tmp/data-bench")
    p.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                   help="the checkout whose builder is measured")
    p.add_argument("--sequential-mb", type=int, default=10)
    args = p.parse_args()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / ("corpus.jsonl" if args.shape == "record" else "corpus.txt")
    for cache in out.glob(f".{corpus.name}.*"):
        cache.unlink()
    write_corpus(corpus, args.mb, args.shape)
    size = corpus.stat().st_size

    build_s, n_tokens, hwm_before, hwm = run(BUILDER, Path(args.root), str(corpus))
    start = time.perf_counter()
    digest = hashlib.blake2b(digest_size=16)
    with open(corpus, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    digest_s = time.perf_counter() - start
    result = {"shape": args.shape, "root": args.root, "corpus_mb": size / 1e6,
              "tokens": int(n_tokens), "build_s": build_s,
              "build_mb_per_s": size / 1e6 / build_s,
              "builder_hwm_mib_before": hwm_before, "builder_hwm_mib": hwm,
              "digest_s": digest_s, "digest_mb_per_s": size / 1e6 / digest_s,
              "cpus": os.cpu_count()}
    here = Path(__file__).resolve().parent.parent
    if args.shape == "text" and Path(args.root).resolve() == here:
        result.update(text_extras(corpus, args.sequential_mb))
    print(json.dumps(result, indent=1))


def text_extras(corpus: Path, sequential_mb: int) -> dict:
    tokenizer = load_tokenizer()
    eot = end_of_text_id(tokenizer)
    # one piece at a time, on the first `sequential_mb` MB
    pieces, done = [], 0
    for piece in next(read_documents(find_sources(corpus))):
        pieces.append(piece)
        done += len(piece.encode())
        if done >= sequential_mb * 1e6:
            break
    start = time.perf_counter()
    for piece in pieces:
        tokenizer.encode(piece, add_special_tokens=False)
    one_s = time.perf_counter() - start

    start = time.perf_counter()
    corpus_tokens(corpus, tokenizer, eot=eot)
    second_s = time.perf_counter() - start
    cache = next(corpus.parent.glob(f".{corpus.name}.*.tokens.u16"))
    anon_before, anon_after, file_pages, hwm = run(
        READER, Path(__file__).resolve().parent.parent, str(cache))
    return {"one_at_a_time_mb_per_s": done / 1e6 / one_s,
            "cache_mb": cache.stat().st_size / 1e6, "second_open_s": second_s,
            "reader_anon_mib_before": anon_before,
            "reader_anon_mib_after": anon_after,
            "reader_file_pages_mib": file_pages, "reader_hwm_mib": hwm}


if __name__ == "__main__":
    main()
