"""Host memory kept in the process: a repeated XLA:CPU call reuses its temporaries instead of faulting them in."""

import json
import os
import platform
import subprocess
import sys

import pytest

PROGRAM = """
import json, resource, sys
from r3jax import allocator
applied = allocator.keep_freed_memory() if sys.argv[1] == "keep" else False
import jax, jax.numpy as jnp

def temporaries(rows):  # a [rows, 8192] fp32 intermediate: rows * 32 KiB of temporaries
    return jax.jit(lambda x: jnp.sum(jnp.sin(jnp.outer(x[:rows], x) + 1.0) * x[:rows, None]))

a, b = temporaries(4096), temporaries(2048)  # 128 MiB and 64 MiB
x = jnp.arange(8192, dtype=jnp.float32)
a(x).block_until_ready()
b(x).block_until_ready()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    b(x).block_until_ready()  # another program's buffers in between
print(json.dumps({"applied": applied, "faults": faults}))
"""

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
                           reason="glibc's malloc only")


def run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=300,
                         check=True, env={k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"})
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc
def test_a_repeated_call_reuses_its_buffer():
    pages = 4096 * 8192 * 4 // 4096
    default = run("default")
    assert min(default["faults"]) > pages // 2, default  # glibc maps and faults the buffer in on every call
    kept = run("keep")
    assert kept["applied"]
    assert max(kept["faults"]) < pages // 50, kept
