"""Which attention runs where, decided in one place: `plan(mesh, platform, backend)` gives the backend of each
attention a run makes (training, prefill, decode) and which CPU-only mechanisms are on. The model dispatches on
it (`Qwen2(attention=...)`), the sampler and the rollout loop ask it, and the run writes it to its config.json
(`as_dict`), so a user can see which path runs.

Backends of causal self-attention (every forward without a cache: training's loss, the sampler's prefill
(`Qwen2.prefill`), teacher-forced evaluation):
- "splash" (TPU): Pallas splash attention (`r3jax.model.splash`): blocks in VMEM, the upper triangle and the
  padding skipped, no [T, T] scores in HBM;
- "cudnn" (GPU): cuDNN flash attention (`r3jax.model.cudnn`);
- "xla" (CPU, and anywhere on request): queries in blocks, each reading only the keys up to its diagonal
  (`attention.attend_causal`).
Attention over a cache (the sampler's decode steps) runs XLA on every platform (the online softmax over cache
blocks, `attention.attend_cached`). Training rows that read a prompt held once per group (`shares_prompts`) run
on XLA (`attention.attend_shared_prefix`: a group's queries meet the prompt in one product) or on splash
(`splash.attend_prefixed`: keys [prompt | own] per row in one kernel call); not on cuDNN, whose padding
(trailing lengths) cannot mark a prompt's left padding in the middle of a row's keys, so rows there keep their
own prompt. Beside splash the XLA form would not do: its [block, P + T] scores live in HBM (compiled for v5e:4x8,
GRPO at the paper's lengths in 8 micro-batches of 128 rows: refused at 18.91 GiB of temporaries).

CPU-only mechanisms (`CpuMechanisms`), each a workaround for how XLA:CPU runs small programs, are on only when
the platform is "cpu": they cost memory or compile time elsewhere and buy nothing there.
"""

from __future__ import annotations

import dataclasses

import jax

from r3jax.model import attention, cudnn, splash

BACKENDS = ("xla", "splash", "cudnn")
DEFAULT_BACKEND = {"cpu": "xla", "gpu": "cudnn", "tpu": "splash"}
# The platform each kernel backend compiles for ("xla" runs everywhere).
BACKEND_PLATFORM = {"splash": "tpu", "cudnn": "gpu"}
CACHED = "xla-online-softmax"  # decode: the cache read in blocks (`attention.attend_cached`)


@dataclasses.dataclass(frozen=True)
class CpuMechanisms:
    """XLA:CPU workarounds, each on only on a CPU.

    sampler_parts: `generate` splits a small model's static batch into programs run from threads of their own
      (`sampling.parts.auto_parts`): XLA:CPU runs a program's small decode ops on part of the cores.
    threads_per_call: a step's sampler calls run from threads of their own (`train.rollouts.threads_per_call`).
    unroll_layers: decode loops run the layers unrolled from per-layer weights transposed to [in, out]
      (`Qwen2.unstack_layers`), where XLA:CPU copied slices of the stacked weights at every step.
    head_tail_cache: the decode cache per layer, its head (prompt and first response slots) read in place and
      its tail in blocks (`cache.Cache`), where XLA:CPU copied every slice of a stacked cache.
    """

    sampler_parts: bool
    threads_per_call: bool
    unroll_layers: bool
    head_tail_cache: bool

    @classmethod
    def for_platform(cls, platform: str) -> CpuMechanisms:
        on = platform == "cpu"
        return cls(sampler_parts=on, threads_per_call=on, unroll_layers=on, head_tail_cache=on)


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    platform: str        # "cpu", "gpu" or "tpu": where the program runs
    train: str           # backend of causal self-attention (BACKENDS)
    shared_prompts: bool  # training rows may read a prompt held once per group (`shares_prompts`)
    prefill: str         # the sampler's prompt pass (a forward without a cache that keeps its keys and values)
    decode: str          # the sampler's decode steps
    cpu: CpuMechanisms

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line for a run's log."""
        cpu = [name for name, on in dataclasses.asdict(self.cpu).items() if on]
        return (f"attention on {self.platform}: train {self.train}"
                f"{' (shared prompts)' if self.shared_prompts else ''}, prefill {self.prefill}, decode {self.decode}; "
                f"CPU mechanisms: {', '.join(cpu) or 'none'}")


def platform_of(where=None) -> str:
    """The platform a program runs on: that of `where`, a device or a mesh's devices (also when compiled ahead of
    time for a TPU topology from a CPU host); None: JAX's default backend. Every platform decision of the
    library goes through here."""
    if where is None:
        return jax.default_backend()
    device = where.devices.flat[0] if hasattr(where, "devices") else where
    return device.platform


def resolve_backend(backend: str, platform: str) -> str:
    """"auto" -> the platform's default; a kernel backend on a platform it does not compile for is an error
    naming both."""
    if backend == "auto":
        return DEFAULT_BACKEND.get(platform, "xla")
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be 'auto' or one of {list(BACKENDS)}, got {backend!r}")
    needs = BACKEND_PLATFORM.get(backend)
    if needs is not None and needs != platform:
        raise ValueError(f"attention backend {backend!r} runs on {needs.upper()} only, and this program runs on "
                         f"{platform!r}; use 'auto' or 'xla'")
    return backend


def plan(*, mesh=None, platform: str | None = None, backend: str = "auto") -> AttentionPlan:
    """The attention plan of a program on `mesh` (or on `platform`, default `platform_of(mesh)`), with the
    causal self-attention backend `backend` ("auto": the platform's, `DEFAULT_BACKEND`)."""
    platform = platform or platform_of(mesh)
    train = resolve_backend(backend, platform)
    return AttentionPlan(platform=platform, train=train, shared_prompts=shares_prompts(train), prefill=train,
                         decode=CACHED, cpu=CpuMechanisms.for_platform(platform))


def shares_prompts(backend: str) -> bool:
    """Whether training rows may read a prompt held once per group with causal self-attention on `backend`
    (`prefixed_attention`): XLA and splash; cuDNN keeps whole rows."""
    return backend in ("xla", "splash")


def cpu_mechanisms(where=None) -> CpuMechanisms:
    """Which CPU-only mechanisms a program on `where` (a mesh or a device; None: JAX's default backend) uses."""
    return CpuMechanisms.for_platform(platform_of(where))


def self_attention(backend: str, q_btnh, k_bksh, v_bksh, mask_bt, *, mesh=None, query_block: int | None = None):
    """Causal self-attention of a forward without a cache with `backend` (resolved: BACKENDS): [B, T, N, H]
    queries over [B, K, T, H] keys and values, real tokens mask_bt [B, T]. Equal values at real positions on
    every backend; query_block bounds the XLA path's blocks (at most `attention.CAUSAL_BLOCK`)."""
    if backend == "splash":
        return splash.attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, mesh=mesh)
    if backend == "cudnn":
        return cudnn.attend_causal(q_btnh, k_bksh, v_bksh, mask_bt)
    return attention.attend_causal(q_btnh, k_bksh, v_bksh, mask_bt, attention.causal_block(query_block))


def prefixed_attention(backend: str, q_btnh, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt, *,
                       mesh=None, query_block: int | None = None):
    """Attention of [B, T] rows that continue Q prefixes (Q groups of B / Q rows in order; prefix keys and values
    [Q, K, P, H], real slots prefix_mask [Q, P]) with `backend` (one that `shares_prompts`): each row over its
    prefix's real slots, then causally over its own real tokens (mask_bt [B, T])."""
    if backend == "splash":
        return splash.attend_prefixed(q_btnh, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt, mesh=mesh)
    if not shares_prompts(backend):
        raise ValueError(f"attention backend {backend!r} does not read shared prompts; rows keep their own")
    return attention.attend_shared_prefix(q_btnh, prefix_k, prefix_v, k_bksh, v_bksh, prefix_mask, mask_bt,
                                          attention.causal_block(query_block))
