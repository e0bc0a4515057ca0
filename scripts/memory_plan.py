"""Compiles a run's train step and sampler for a device topology and prints one JSON line per program.

    python scripts/memory_plan.py --config configs/r1distill_1p5b.py --topology v5e:4x8
    python scripts/memory_plan.py --config configs/tiny.py --topology cpu --config.rl.num_micro_batches=2

TPU topologies (`v5e:4x8`, `v4:2x2x4`, `v5p:2x2x4`, `v6e:2x4`) need `jax[tpu]` (libtpu) installed, not a TPU:
the TPU compiler runs on this CPU. `cpu` uses this host's devices (set
`XLA_FLAGS=--xla_force_host_platform_device_count=8` for eight). See `r3jax/train/memory_plan.py` for what
each field means, and docs/SCALING.md for the plans of the paper's run.
"""

import json
import os
import sys

from absl import app, flags
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from r3jax import model as rm  # noqa: E402
from r3jax.train import config as run_config  # noqa: E402
from r3jax.train import memory_plan  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/r1distill_1p5b.py", "a configs/*.py file")
_TOPOLOGY = flags.DEFINE_string("topology", "v5e:4x8", "'cpu' or a TPU topology <kind>:<AxB[xC]>")
_PROGRAMS = flags.DEFINE_list("programs", ["train_step", "sampler"], "which programs to compile")
_MODEL = flags.DEFINE_string("model", None, "a ModelConfig preset in r3jax.model (default: the config's "
                             "model.init with its overrides, else deepseek_r1_distill_qwen_1p5b); no weights are read")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 1024, "padded prompt width Tp")
_QUESTIONS = flags.DEFINE_integer("num_questions", 40315, "replay buffer questions Q (DeepScaleR: 40,315)")
_OUTPUT = flags.DEFINE_string("output", None, "also append the lines to this file")


def _accelerator_type(topology: str) -> str:
    """libtpu's name for the slice (it warns when unset): v5e and v6e count chips, v4 and v5p cores."""
    kind, dims = topology.split(":")
    chips = 1
    for d in dims.split("x"):
        chips *= int(d)
    return {"v5e": f"v5litepod-{chips}", "v6e": f"v6e-{chips}"}.get(kind, f"{kind}-{2 * chips}")


def _model_config(c) -> rm.ModelConfig:
    name = _MODEL.value or c.model.init or "deepseek_r1_distill_qwen_1p5b"
    overrides = c.model.init_overrides.to_dict() if name == c.model.init else {}
    return getattr(rm, name)(**overrides)


def main(argv):
    del argv
    c = _CONFIG.value
    topology = _TOPOLOGY.value
    if topology != "cpu":
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", _accelerator_type(topology))
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    devices, chip = memory_plan.devices(topology)
    records = memory_plan.plan(c, _model_config(c), devices, chip, topology=topology,
                               prompt_tokens=_PROMPT_TOKENS.value, num_questions=_QUESTIONS.value,
                               programs=tuple(_PROGRAMS.value))
    for rec in records:
        line = json.dumps(rec)
        print(line, flush=True)
        if _OUTPUT.value:
            with open(_OUTPUT.value, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    run_config.check_overrides(sys.argv[1:], run_config.base_config())
    app.run(main)
