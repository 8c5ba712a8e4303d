"""Benchmark of the fine-tune's data preparation (not a test; timings are noisy).

    python -m bench.data_prep --mb 200 --dir /tmp/data-bench

1. writes a corpus of `--mb` MB of text: Tiny Shakespeare's paragraphs repeated
   and shuffled (seeded);
2. builds its token file with the batch API (`corpus_tokens`) and times it;
3. times the tokenizer called one piece at a time on a part of it;
4. opens the cached file again (the second run's preparation) and times it;
5. in a fresh process, memory-maps the token file and reads random samples as a
   rank does, and reports that process's peak resident memory.
"""

from __future__ import annotations

import argparse
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
READER = """
import sys, numpy as np, torch
from labml_zero.finetune.dataset import TextDataset
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 2**10
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


def write_corpus(path: Path, mb: int) -> None:
    paragraphs = load_text().split("\n\n")
    rng = np.random.default_rng(0)
    written = 0
    with open(path, "w") as f:
        while written < mb * 1e6:
            for i in rng.permutation(len(paragraphs)):
                f.write(paragraphs[i] + "\n\n")
                written += len(paragraphs[i]) + 2
            # one pass is about 1.1 MB; stop at the size asked for


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=200)
    p.add_argument("--dir", default="/tmp/data-bench")
    p.add_argument("--sequential-mb", type=int, default=10)
    args = p.parse_args()
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    for cache in out.glob(".corpus.txt.*"):
        cache.unlink()
    write_corpus(corpus, args.mb)
    size = corpus.stat().st_size
    tokenizer = load_tokenizer()
    eot = end_of_text_id(tokenizer)

    start = time.perf_counter()
    tokens = corpus_tokens(corpus, tokenizer, eot=eot)
    batch_s = time.perf_counter() - start
    cache = next(out.glob(".corpus.txt.*"))

    # one piece at a time, on the first `--sequential-mb` MB
    pieces, done = [], 0
    for piece in next(read_documents(find_sources(corpus))):
        pieces.append(piece)
        done += len(piece.encode())
        if done >= args.sequential_mb * 1e6:
            break
    start = time.perf_counter()
    for piece in pieces:
        tokenizer.encode(piece, add_special_tokens=False)
    one_s = time.perf_counter() - start

    start = time.perf_counter()
    corpus_tokens(corpus, tokenizer, eot=eot)
    second_s = time.perf_counter() - start

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    anon_before, anon_after, file_pages, hwm = map(float, subprocess.run(
        [sys.executable, "-c", READER, str(cache)], env=env, capture_output=True,
        text=True, check=True).stdout.split())
    print(json.dumps({
        "corpus_mb": size / 1e6, "tokens": len(tokens),
        "batch_mb_per_s": size / 1e6 / batch_s, "batch_s": batch_s,
        "one_at_a_time_mb_per_s": done / 1e6 / one_s,
        "cache_mb": cache.stat().st_size / 1e6,
        "second_open_s": second_s,
        "reader_anon_mib_before": anon_before, "reader_anon_mib_after": anon_after,
        "reader_file_pages_mib": file_pages, "reader_hwm_mib": hwm,
        "cpus": os.cpu_count()}, indent=1))


if __name__ == "__main__":
    main()
