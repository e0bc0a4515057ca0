"""Huge pages for host memory: a repeated XLA:CPU call no longer faults its temporaries in 4 KiB at a time."""

import json
import os
import subprocess
import sys

import pytest

from r3jax import allocator

PROGRAM = """
import json, resource
import jax, jax.numpy as jnp

@jax.jit
def program(x):  # a [4096, 8192] fp32 intermediate: 128 MiB of temporaries
    y = jnp.outer(x[:4096], x) + 1.0
    return jnp.sum(jnp.sin(y) * y)

x = jnp.arange(8192, dtype=jnp.float32)
program(x).block_until_ready()
faults = []
for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    program(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""

needs_thp = pytest.mark.skipif(allocator.huge_page_env({}) is None,
                               reason="needs Linux, glibc >= 2.35 and transparent huge pages")


@needs_thp
def test_huge_pages_cut_the_page_faults_of_a_repeated_call():
    def faults(env):
        out = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True,
                             timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    pages = 4096 * 8192 * 4 // 4096
    assert min(faults(plain)) > pages // 2  # without: the buffer is faulted in again at every call
    assert max(faults(allocator.huge_page_env(plain))) < pages // 20


@needs_thp
def test_use_huge_pages_reexecutes_the_command_once_with_the_tunable(tmp_path):
    script = tmp_path / "entry.py"
    script.write_text("import os, sys\nprint('start', flush=True)\nfrom r3jax import allocator\n"
                      "allocator.use_huge_pages()\nprint(os.environ['GLIBC_TUNABLES'], sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env["GLIBC_TUNABLES"] = "glibc.malloc.arena_max=4"  # kept
    out = subprocess.run([sys.executable, str(script), "--flag", "a b"], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out == ["start", "start", f"glibc.malloc.arena_max=4:{allocator.TUNABLE} ['--flag', 'a b']"]


def test_the_opt_out_and_an_existing_setting_change_nothing():
    assert allocator.huge_page_env({allocator.OPT_OUT: "0"}) is None
    assert allocator.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
