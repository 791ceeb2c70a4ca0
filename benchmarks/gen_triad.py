"""The machine's memory bandwidth, measured in the run: a STREAM-like triad
(``a[i] = b[i] + s * c[i]`` over three 64 MiB arrays of doubles, far past any cache) in a
tiny C program compiled at run time with OpenMP, on the threads every system gets.

Decode reads every weight once per token, so ``weight bytes read per token / bandwidth``
is the fastest a token can be; the report puts it beside each c1 ITL. The triad moves 3
arrays per pass (two read, one written; write-allocate not counted, as STREAM reports it)
and the best of its passes is taken (STREAM's rule: the least disturbed pass).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

TRIAD_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <omp.h>
#define N (8L * 1024 * 1024)
int main(int argc, char **argv) {
    int passes = argc > 1 ? atoi(argv[1]) : 10;
    double *a = malloc(N * sizeof(double)), *b = malloc(N * sizeof(double));
    double *c = malloc(N * sizeof(double));
    #pragma omp parallel for
    for (long i = 0; i < N; i++) { a[i] = 0.0; b[i] = 1.0; c[i] = 2.0; }
    for (int p = 0; p < passes; p++) {
        double start = omp_get_wtime();
        #pragma omp parallel for
        for (long i = 0; i < N; i++) a[i] = b[i] + 3.0 * c[i];
        double seconds = omp_get_wtime() - start;
        printf("triad pass %d bytes %ld seconds %.9f threads %d\n", p, 3 * N * (long)sizeof(double),
               seconds, omp_get_max_threads());
    }
    return a[N / 2] == 7.0 ? 0 : 2;
}
"""

PASS_LINE = re.compile(r"^triad pass (\d+) bytes (\d+) seconds ([0-9.eE+-]+) threads (\d+)$")


def parse_triad(output: str) -> dict[str, float]:
    """The best pass's bandwidth (GB/s, 1e9 bytes) and the thread count, from the program's
    lines; a run with no pass line is an error naming what it printed."""
    passes = [PASS_LINE.match(line.strip()) for line in output.splitlines()]
    found = [m for m in passes if m]
    if not found:
        raise ValueError(f"no triad pass in the output: {output[:200]!r}")
    rates = [int(m[2]) / float(m[3]) for m in found if float(m[3]) > 0]
    if not rates:
        raise ValueError("every triad pass took zero seconds")
    return {
        "gb_per_s": round(max(rates) / 1e9, 2),
        "median_gb_per_s": round(sorted(rates)[len(rates) // 2] / 1e9, 2),
        "threads": float(found[0][4]),
        "passes": float(len(found)),
    }


def measure_bandwidth(threads: int, passes: int = 20) -> dict[str, float]:
    """Compile the triad (gcc -O2 -fopenmp) and run it on ``threads`` threads."""
    with tempfile.TemporaryDirectory(prefix="triad-") as scratch:
        source, binary = Path(scratch) / "triad.c", Path(scratch) / "triad"
        source.write_text(TRIAD_C)
        compile_ = ["gcc", "-O2", "-march=native", "-fopenmp", str(source), "-o", str(binary)]
        subprocess.run(compile_, check=True, capture_output=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "false"}
        done = subprocess.run(
            [str(binary), str(passes)], env=env, capture_output=True, text=True, check=True
        )
    return parse_triad(done.stdout)


def bytes_floor_ms(weight_bytes: float, gb_per_s: float) -> float:
    """The fastest a token can be when it reads ``weight_bytes`` at ``gb_per_s``."""
    return weight_bytes / (gb_per_s * 1e9) * 1e3
