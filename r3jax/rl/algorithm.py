"""RL settings as one frozen config, and the three algorithms the same code runs (R3-SPEC §8).

Every DECIDED value of R3-SPEC is a field here, with the spec's default. `algorithm_config(name)`
gives the settings of `grpo`, `dapo` or `r3`; `r3.replay`, `r3.reflection`, `r3.ranking` switch R³'s
parts off one at a time for the paper's ablation.
"""

from __future__ import annotations

import dataclasses

from r3jax.rl import reflection, serr

ALGORITHMS = ("grpo", "dapo", "r3")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
DEFAULT_REFLECTION_INSTRUCTION = reflection.DEFAULT_REFLECTION_INSTRUCTION  # R3Config's field `reflection` shadows


@dataclasses.dataclass(frozen=True)
class R3Config:
    replay: bool = True                  # §4 CCR
    reflection: bool = True              # §5 ISR
    ranking: bool = True                 # §6 SERR
    replay_k: int = 2                    # §4 k: replayed responses appended per collapsed group
    alpha: float = 1.0                   # §4 Eq. 3
    lam: float = 1e-6                    # §4 Eq. 3 lambda
    slots_correct: int = 2               # §4 buffer ring sizes per question
    slots_wrong: int = 2
    tau: float = 0.2                     # §5 hard: accuracy below tau
    reflection_start_epoch: int = 2      # §5 1-based: from the second epoch
    max_reflection_prompts: int = 8      # §5 extra prompts per batch (fixed shape)
    reflection_attempt_tokens: int = 1024  # §5 tail of the wrong attempt shown
    reflection_instruction: str = DEFAULT_REFLECTION_INSTRUCTION
    serr_p: float = 0.2                  # §6 peak fraction
    serr_r_max: float = 0.5              # §6
    serr_scope: str = "truncated"        # §6 "truncated" or "failed"

    def __post_init__(self):
        _check(self.replay_k >= 1, "r3.replay_k", self.replay_k, "at least 1")
        _check(self.alpha > 0, "r3.alpha", self.alpha, "positive")
        _check(self.lam >= 0, "r3.lam", self.lam, "non-negative")
        _check(self.slots_correct >= 1 and self.slots_wrong >= 1, "r3.slots_correct/slots_wrong",
               (self.slots_correct, self.slots_wrong), "at least 1")
        _check(0.0 <= self.tau <= 1.0, "r3.tau", self.tau, "in [0, 1]")
        _check(self.reflection_start_epoch >= 1, "r3.reflection_start_epoch", self.reflection_start_epoch,
               "at least 1 (1-based)")
        _check(self.max_reflection_prompts >= 0, "r3.max_reflection_prompts", self.max_reflection_prompts,
               "non-negative")
        _check(self.reflection_attempt_tokens >= 1, "r3.reflection_attempt_tokens", self.reflection_attempt_tokens,
               "at least 1")
        serr.SERRConfig(p=self.serr_p, r_max=self.serr_r_max, scope=self.serr_scope)  # validates

    @property
    def serr(self) -> serr.SERRConfig:
        return serr.SERRConfig(p=self.serr_p, r_max=self.serr_r_max, scope=self.serr_scope)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    algorithm: str = "r3"
    eps_low: float = 0.2                 # §2 clip range
    eps_high: float = 0.28               # §2 clip-higher
    aggregation: str = "token-mean"      # §2
    beta: float = 0.0                    # §2 k3 KL weight; 0 builds no reference model
    old_logprobs: str = "recompute"      # §2 "recompute" or "sampler" (replayed samples always recompute)
    adv_eps: float = 1e-6                # Eq. 1 std + eps
    temperature: float = 1.0             # the sampling temperature: log-probs are of softmax(logits / T)
    max_length_reward: int = 32768       # §3 L_max of the length bonus
    learning_rate: float = 1e-6
    warmup_steps: int = 0
    total_steps: int | None = None       # cosine decay to 0 when set; constant after warmup otherwise
    weight_decay: float = 0.0              # AdamW decay moves params even when every advantage is 0
    max_grad_norm: float = 1.0
    num_micro_batches: int = 1           # gradient accumulation inside one step
    chunk_size: int = 512                # tokens per chunk of the log-prob head
    valid_vocab: int | None = None       # ids >= this are masked (151665 for R1-Distill)
    dynamic_sampling: bool = False       # DAPO: keep groups with reward variance
    oversample: float = 1.0              # DAPO: questions sampled per kept group
    overlong_buffer: int = 0             # DAPO: soft length penalty over the last tokens of the budget
    max_response_tokens: int = 8192      # generation budget (the buffer's T)
    bucket_min_width: int = 64           # the loss reads W <= T response columns, a power of two >= this (0: T)
    bucket_replay: bool = True           # the loss's replay rows: as many as CCR fills, bucketed (False: P·k)
    share_prompts: bool = True           # a group's rows run its prompt once per micro-batch (False: every row);
                                         # on one device's rows only (`train_step.make_train_step`)
    r3: R3Config = dataclasses.field(default_factory=R3Config)

    def __post_init__(self):
        _check(self.algorithm in ALGORITHMS, "algorithm", self.algorithm, f"one of {ALGORITHMS}")
        _check(self.aggregation in AGGREGATIONS, "aggregation", self.aggregation, f"one of {AGGREGATIONS}")
        _check(0 <= self.eps_low < 1 and self.eps_high >= 0, "eps_low/eps_high", (self.eps_low, self.eps_high),
               "0 <= eps_low < 1 and eps_high >= 0")
        _check(self.beta >= 0, "beta", self.beta, "non-negative")
        _check(self.old_logprobs in ("recompute", "sampler"), "old_logprobs", self.old_logprobs,
               "'recompute' or 'sampler'")
        _check(self.temperature > 0, "temperature", self.temperature, "positive")
        _check(self.num_micro_batches >= 1, "num_micro_batches", self.num_micro_batches, "at least 1")
        _check(self.oversample >= 1, "oversample", self.oversample, "at least 1")
        _check(self.bucket_min_width >= 0, "bucket_min_width", self.bucket_min_width, "non-negative")
        _check(0 <= self.overlong_buffer < self.max_response_tokens, "overlong_buffer", self.overlong_buffer,
               "in [0, max_response_tokens)")
        _check(self.learning_rate > 0, "learning_rate", self.learning_rate, "positive")
        _check(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, "non-negative")
        _check(self.total_steps is None or self.total_steps >= 1, "total_steps", self.total_steps, "at least 1 or None")
        _check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "non-negative")
        _check(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "positive")
        _check(self.adv_eps > 0, "adv_eps", self.adv_eps, "positive")
        _check(self.max_length_reward >= 1, "max_length_reward", self.max_length_reward, "at least 1")
        _check(self.chunk_size >= 1, "chunk_size", self.chunk_size, "at least 1")
        _check(self.max_response_tokens >= 1, "max_response_tokens", self.max_response_tokens, "at least 1")
        _check(self.valid_vocab is None or self.valid_vocab >= 1, "valid_vocab", self.valid_vocab, "at least 1 or None")

    @property
    def uses_replay(self) -> bool:
        return self.algorithm == "r3" and self.r3.replay

    @property
    def uses_reflection(self) -> bool:
        return self.algorithm == "r3" and self.r3.reflection

    @property
    def uses_ranking(self) -> bool:
        return self.algorithm == "r3" and self.r3.ranking


def algorithm_config(name: str, **overrides) -> RLConfig:
    """The settings of one algorithm (R3-SPEC §8), with any field overridden.

    grpo: no R³ parts, eps 0.2/0.2, seq-mean-token-mean. dapo: clip-higher, token-mean, dynamic sampling
    (2x over-sampling) and overlong reward shaping over the last fifth of the budget. r3: §4-§6 on,
    clip-higher, token-mean.
    """
    presets = {
        "grpo": dict(algorithm="grpo", eps_low=0.2, eps_high=0.2, aggregation="seq-mean-token-mean"),
        "dapo": dict(algorithm="dapo", eps_low=0.2, eps_high=0.28, aggregation="token-mean", dynamic_sampling=True,
                     oversample=2.0),
        "r3": dict(algorithm="r3", eps_low=0.2, eps_high=0.28, aggregation="token-mean"),
    }
    if name not in presets:
        raise ValueError(f"unknown algorithm {name!r}; expected one of {ALGORITHMS}")
    r3_overrides = overrides.pop("r3", None)
    settings = {**presets[name], **overrides}
    if name == "dapo" and "overlong_buffer" not in overrides:  # DAPO: the last fifth (4096 of 20480 tokens)
        settings["overlong_buffer"] = settings.get("max_response_tokens", RLConfig.max_response_tokens) // 5
    config = RLConfig(**settings)
    if isinstance(r3_overrides, dict):
        config = dataclasses.replace(config, r3=R3Config(**r3_overrides))
    elif r3_overrides is not None:
        config = dataclasses.replace(config, r3=r3_overrides)
    return config


def _check(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"RL config field {field} must be {expected}, got {value!r}")
