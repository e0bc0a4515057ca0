"""Load time and peak host memory of `load_pretrained` vs transformers' `from_pretrained`, same folder.

Usage: python bench/load_checkpoint.py [--rounds 3]
Writes a random ~100M-parameter Qwen2 checkpoint (fp32 safetensors), then loads it in fresh
subprocesses, alternating r3jax and transformers, and reports medians of wall time and of the
child's peak RSS (VmHWM) above its own import-only baseline. transformers memory-maps safetensors and
returns before reading the weights (`transformers_load_s`, `transformers_unread_...`): the ratio and the
peak compare r3jax's load with transformers' load plus reading every weight page once
(`transformers_load_and_read_s`), which is where both stand when the first forward can start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import emit  # noqa: E402

CHILD = r"""
import json, sys, time

def hwm_kb():  # the peak RSS of this process image (ru_maxrss would carry the parent's peak over exec)
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1])

which, folder, load = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if which == "r3jax":
    import jax
    from r3jax import model as rm
else:
    import torch
    from transformers import Qwen2ForCausalLM
base = hwm_kb()
start = time.perf_counter()
if load and which == "r3jax":
    model, _ = rm.load_pretrained(folder)
    jax.block_until_ready(rm.split_params(model)[1])
elif load:
    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
seconds = time.perf_counter() - start
lazy_peak = hwm_kb()
if load and which != "r3jax":
    # transformers keeps safetensors weights memory-mapped: from_pretrained returns before reading them. Read one
    # float per 4 KiB page of every weight, so the weights are in memory as r3jax's are when its load returns.
    with torch.no_grad():
        sum(float(p.reshape(-1)[::1024].sum()) for p in model.parameters())
touched = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "touched_seconds": touched, "peak_kb": hwm_kb(), "lazy_peak_kb": lazy_peak,
                  "base_kb": base}))
"""


def child(which, folder):
    out = subprocess.run([sys.executable, "-c", CHILD, which, folder, "1"], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from r3jax import model as rm

    cfg = rm.small_100m()
    hf_cfg = Qwen2Config(**{k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        Qwen2ForCausalLM(hf_cfg).save_pretrained(folder)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
        runs = {"r3jax": [], "transformers": []}
        for _ in range(args.rounds):
            for which in runs:
                runs[which].append(child(which, folder))
    med = {w: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "touched_seconds", "peak_kb",
                                                                 "lazy_peak_kb", "base_kb")}
           for w, rs in runs.items()}
    mb = lambda kb: round(kb / 1024, 1)  # noqa: E731
    emit({"bench": "load_checkpoint", "params": cfg.num_params(), "file_mb": round(size / 2**20, 1),
          "r3jax_load_s": round(med["r3jax"]["seconds"], 3),
          "transformers_load_s": round(med["transformers"]["seconds"], 3),
          "transformers_load_and_read_s": round(med["transformers"]["touched_seconds"], 3),
          "time_ratio": round(med["transformers"]["touched_seconds"] / med["r3jax"]["seconds"], 3),
          "r3jax_peak_rss_above_imports_mb": mb(med["r3jax"]["peak_kb"] - med["r3jax"]["base_kb"]),
          "transformers_peak_rss_above_imports_mb": mb(med["transformers"]["peak_kb"] - med["transformers"]["base_kb"]),
          "transformers_unread_peak_rss_above_imports_mb": mb(med["transformers"]["lazy_peak_kb"]
                                                              - med["transformers"]["base_kb"]),
          "r3jax_peak_rss_mb": mb(med["r3jax"]["peak_kb"]),
          "transformers_peak_rss_mb": mb(med["transformers"]["peak_kb"]),
          "rounds": args.rounds})


if __name__ == "__main__":
    main()
