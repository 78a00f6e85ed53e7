#!/usr/bin/env python3
"""Where a process's CPU goes, by thread and by kind of code, from a `perf record -a -g` file.

    perf record -a -F 499 -g -o drain.data -- ferry-bench --only drains
    python3 bench/tools/perf-split.py drain.data ferry-forwarder

Counts the samples of every process whose main thread is named COMM (a bench run starts one
forwarder per drain) and splits them by thread and by the kind of the sampled function: the
kernel (system calls, wakeups), clock reads, lz4, allocation and memory copies, librdkafka,
tokio, Ferry's own code. Sampled without call chains through librdkafka (it is built without
frame pointers), so a function is classified by its own name only.
"""
import collections
import subprocess
import sys

KINDS = [
    ("clock reads", ("clock_gettime", "gettimeofday")),
    ("lz4", ("LZ4",)),
    ("alloc/mem", ("malloc", "free", "calloc", "realloc", "memcpy", "memmove", "memset",
                   "memcmp", "unlink_chunk")),
    ("ferry code", ("ferry_", "prometheus")),
    ("tokio", ("tokio", "PollFn", "Pin<P>")),
]
LIBRDKAFKA = ("rd_", "mtx_", "cnd_", "thrd", "__poll", "__GI", "pthread")


def kind(ip, sym):
    if ip.startswith("ffffffff"):
        return "kernel"
    for name, marks in KINDS:
        if any(m in sym for m in marks):
            return name
    if sym.startswith(LIBRDKAFKA):
        return "librdkafka"
    return "other"


def samples(path):
    """(comm, pid, ip, sym) of every sample's leaf frame."""
    out = subprocess.run(
        ["perf", "script", "-i", path, "-F", "comm,pid,tid,ip,sym", "-G"],
        check=True, capture_output=True, text=True,
    ).stdout
    for line in out.splitlines():
        fields = line.split()
        at = next((i for i, f in enumerate(fields) if "/" in f and f.split("/")[0].isdigit()), None)
        if at is None or at + 1 >= len(fields):
            continue
        yield " ".join(fields[:at]), fields[at].split("/")[0], fields[at + 1], " ".join(fields[at + 2:])


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path, comm = sys.argv[1], sys.argv[2]
    rows = list(samples(path))
    pids = {pid for c, pid, _, _ in rows if c == comm}
    if not pids:
        sys.exit(f"no samples of a process named {comm!r} in {path}")
    threads, kinds = collections.Counter(), collections.Counter()
    for c, pid, ip, sym in rows:
        if pid not in pids:
            continue
        thread = "rdk:broker" if c.startswith("rdk:broker") else c
        threads[thread] += 1
        kinds[(thread, kind(ip, sym))] += 1
    total = sum(threads.values())
    print(f"{total} samples of {len(pids)} {comm} processes")
    for thread, n in threads.most_common():
        parts = sorted(((v, k) for (t, k), v in kinds.items() if t == thread), reverse=True)
        split = ", ".join(f"{k} {100 * v / total:.1f} %" for v, k in parts)
        print(f"{thread}: {100 * n / total:.0f} % ({split})")


if __name__ == "__main__":
    main()
