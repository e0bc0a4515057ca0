"""The paper's run: DeepSeek-R1-Distill-Qwen-1.5B trained with R³ on DeepScaleR-Preview (R3-SPEC §10).

    python train.py --config configs/r1distill_1p5b.py --workdir runs/r3_1p5b \
        --config.model.path=/models/DeepSeek-R1-Distill-Qwen-1.5B --config.data.train=/data/deepscaler.json

Baselines: `--config.algorithm=grpo` or `dapo`; ablations: `--config.rl.r3.replay=False` (no CCR),
`.reflection=False` (no ISR), `.ranking=False` (no SERR); each keeps 16 loss rows per micro-batch
(`micro_batch_rows`), whatever its row count. Evaluation sets are read from $R3JAX_DATA
(default `data/`), in rllm's layout: test/{aime,amc,math,minerva,olympiad_bench}.json.
"""

import os

import ml_collections

from r3jax.train import config as run_config

DATA = os.environ.get("R3JAX_DATA", "data")


def get_config():
    c = run_config.base_config()
    c.algorithm = "r3"
    c.model.path = "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"  # a local folder, or fetched when the hub is reachable
    c.model.dtype = "float32"              # fp32 master weights and Adam moments (~28 GB sharded over the mesh)
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "full"                 # per-layer: the backward recomputes each layer from its input
    c.data.train = "agentica-org/DeepScaleR-Preview-Dataset"  # or a local copy of its JSON
    c.data.eval = ml_collections.ConfigDict({
        name: os.path.join(DATA, "test", f"{file}.json")
        for name, file in (("aime24", "aime"), ("amc", "amc"), ("math500", "math"), ("minerva", "minerva"),
                           ("olympiad", "olympiad_bench"))})
    c.prompts_per_step = 128               # P
    c.samples_per_prompt = 8               # G
    c.max_new_tokens = 8192                # the 8K response budget
    c.temperature = 0.6
    c.top_p = 1.0                          # no truncation while training: π_old is the full softmax
    c.steps = 1000
    c.seed = 0
    c.checkpoint_every = 25
    c.eval_every = 50
    c.keep_checkpoints = 3
    c.rl.learning_rate = 1e-6
    # Fits a v5e-32 slice (32 chips x 16 GiB) with >= 15% headroom; plans for other slices in docs/SCALING.md
    # (`scripts/memory_plan.py` regenerates them). KV heads K = 2 set the tensor axis to 2; the rest is FSDP.
    c.mesh.data = 1
    c.mesh.fsdp = 16
    c.mesh.tensor = 2
    # The loss has (128 + 8 reflection slots) x (8 + 2 replayed) = 1360 rows of 9216 tokens: 85 micro-batches
    # of 16 rows, one row per data x fsdp shard (a micro-batch the batch axes do not divide runs replicated),
    # whose attention runs Pallas splash on TPU (`model.attention`, docs/SCALING.md). (GRPO: 1024 rows, 64.)
    c.micro_batch_rows = 16
    c.rl.chunk_size = 512                  # head tokens per chunk: [rows, 512, V/2] fp32 logits at a time
    # Rows per sampler call: 32 prompts x 8 = 2 prompts per batch shard (a chunk's prompts must split over the
    # 16 data x fsdp shards, or its prefill runs replicated); the 1088 rows take 5 calls, the last one padded.
    c.sampling_chunk = 256
    # Each call decodes until its longest row ends, its 8 samples of a prompt reading the prompt from one copy
    # (4.5 GiB a chip). `--config.sampling_slots=256` refills finished rows' slots with waiting rows instead
    # (each device's slots its own rows, each with a copy of its prompt), for calls of 512 rows (4.8 GiB) or
    # all 1088 (--config.sampling_chunk=0, 8.0 GiB): fewer steps when most responses end well before 8K. Not
    # the default: its speed on TPU is not measured (docs/SCALING.md).
    c.eval.greedy = False                  # DeepScaleR's protocol: T 0.6, top-p 0.95 (eval.py averages 16)
    c.eval.num_samples = 1
    c.eval.batch_size = 128
    c.eval.max_new_tokens = 8192
    c.grading.timeout_s = 5.0
    return c
