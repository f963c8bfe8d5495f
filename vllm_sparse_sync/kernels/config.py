"""Fixed launch configuration of the indexer kernels, one frozen dataclass per kernel family.

No autotuning: every value here is a static choice, so a captured graph replays the same
schedule. Measurements behind the defaults are in ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

TOPK_ALGOS = ("auto", "radix", "sample", "cuda_radix")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _pow2(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v & (v - 1):
        raise ValueError(f"{name}: must be a power of two, got {v!r}")


def _positive(name: str, v: object) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name}: must be a positive int, got {v!r}")


def _flag(name: str, v: object) -> None:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: must be a bool, got {v!r}")


def _plain_values(obj) -> None:
    """A frozen config's numpy integers and bools as Python ints and bools, before its checks."""
    for f in fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.bool_):
            object.__setattr__(obj, f.name, bool(v))
        elif isinstance(v, np.integer):
            object.__setattr__(obj, f.name, int(v))


@dataclass(frozen=True)
class ScorerConfig:
    """The paged fp8 scorer (``triton_scorer``)."""

    tile: int = 64
    """Tokens per loop iteration; a tile of exactly one page loads its K from one page id."""
    warps: int = 4
    stages: int = 6
    """Software-pipeline depth of the K loads."""
    ctas_per_sm: int = 4
    """Scorer programs per SM, split over the call's rows."""
    precise: bool = True
    """fp16 dot of the e4m3 values (exact products, fp32 sums, as the reference); False: the fp8
    tensor-core dot (~14 mantissa bits in its sums, as DeepGEMM)."""
    cuda: bool = True
    """The exact path on the NVRTC-compiled wgmma scorer (``cuda_scorer``) on compute capability
    9.0 where it can take the call (64-token pages, head dim 128, 32 or 64 heads); False: always
    Triton (the e4m3 path too; it takes the CUDA kernel only by ``cuda_fp8_min_tokens`` or
    ``cuda_fp8_one_row_min_width``). ``tile``, ``warps`` and ``stages`` are the Triton kernel's."""
    cuda_min_rows: int = 8
    """Calls of fewer rows take Triton's exact scorer unless their width bound reaches
    ``cuda_min_width`` (or, for one row, ``cuda_one_row_min_width``)."""
    cuda_min_width: int = 4096
    """The width bound from which calls of any row count take the CUDA exact scorer (0: never by
    width). 2-4 rows of 4K-16K measured 1.4-6.2% faster there (benchmarks/NOTES.md, run 167; in
    run 90, before the scorer's evict-first copies, Triton was slightly faster at 2-4 rows of
    8K-16K)."""
    cuda_one_row_min_width: int = 4096
    """The width bound from which a one-row call takes the CUDA exact scorer (0: only from
    ``cuda_min_width``): one row of 4K-16K scores as fast or faster there (benchmarks/NOTES.md,
    runs 90, 93 and 94)."""
    cuda_fp8_min_tokens: int = 4096
    """The e4m3 path (``precise`` False) takes the CUDA scorer for calls of at least this many
    rows x width-bound tokens (0: never by size; Triton's e4m3 kernel below it): since its page
    copies leave the logits in L2 (evict-first), its step measured 0.5-4.4% faster from one row of
    64K to 128 rows of 8K (benchmarks/NOTES.md, run 156; before them it lost at 2-16 rows of 64K,
    runs 138-139), and 0.985-1.001 of Triton's at calls of 4K-32K tokens, 1-8 rows (runs 157,
    165 and 166). Smaller calls (under 4096 rows x width tokens) stay on Triton: not measured."""
    cuda_fp8_one_row_min_width: int = 0
    """The e4m3 path takes the CUDA scorer for one-row calls of a width bound of at least this
    (0: only by ``cuda_fp8_min_tokens``)."""
    cuda_ctas_per_sm: int = 1
    """The CUDA scorer's programs per SM, split over the call's rows (one CTA of its kernel holds
    more than half an SM's registers)."""
    cuda_narrow_rows: int = 0
    """Calls of at most this many rows run the CUDA scorer built with ``cuda_scorer.NARROW_CONSUMERS``
    consumer warpgroups a CTA instead of ``cuda_scorer.CONSUMERS`` (0: never). Chosen from the row
    count only, never the width bound. Opt-in (1: one-row calls): on some machines, in processes
    that had loaded DeepGEMM, vLLM's kernels, the CUDA top-k and SGLang's cubin together, its first
    launch did not finish within minutes, with cubins that finished elsewhere (benchmarks/NOTES.md,
    sessions 22-23)."""
    launch_dependents: bool = True
    """Each program lets the next kernel launch as it starts (``griddepcontrol.launch_dependents``,
    where Triton has it): the step's CUDA top-k, a programmatic dependent launch, is then resident
    and waiting when the scores are done; it still reads them only after the whole scorer."""
    pdl: bool = True
    """The CUDA scorer is a programmatic dependent launch: its CTAs may start while the stream's
    previous kernel finishes, and wait for it to complete before any global access (and before
    letting their own dependents launch). With the CUDA top-k letting the next kernel launch once
    its own wait is over, back-to-back steps measured 0.4-0.7 us faster from 1 to 128 rows, and a
    step after a kernel that does not let it launch early 0.1-0.4 us (benchmarks/NOTES.md, run
    185; no gain at 32-64 rows of 64K)."""

    def __post_init__(self) -> None:
        _plain_values(self)
        _flag("scorer.cuda", self.cuda)
        _flag("scorer.launch_dependents", self.launch_dependents)
        _flag("scorer.pdl", self.pdl)
        _pow2("scorer.tile", self.tile)
        _pow2("scorer.warps", self.warps)
        _positive("scorer.stages", self.stages)
        _positive("scorer.ctas_per_sm", self.ctas_per_sm)
        _positive("scorer.cuda_ctas_per_sm", self.cuda_ctas_per_sm)
        if not _is_int(self.cuda_narrow_rows) or self.cuda_narrow_rows < 0:
            raise ValueError(f"scorer.cuda_narrow_rows: an int >= 0 (0: never), "
                             f"got {self.cuda_narrow_rows!r}")
        if not _is_int(self.cuda_min_rows) or self.cuda_min_rows < 0:
            raise ValueError(f"scorer.cuda_min_rows: an int >= 0, got {self.cuda_min_rows!r}")
        if not _is_int(self.cuda_min_width) or self.cuda_min_width < 0:
            raise ValueError(f"scorer.cuda_min_width: an int >= 0 (0: never by width), "
                             f"got {self.cuda_min_width!r}")
        if not _is_int(self.cuda_one_row_min_width) or self.cuda_one_row_min_width < 0:
            raise ValueError(f"scorer.cuda_one_row_min_width: an int >= 0 (0: only from cuda_min_width), "
                             f"got {self.cuda_one_row_min_width!r}")
        for name in ("cuda_fp8_min_tokens", "cuda_fp8_one_row_min_width"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"scorer.{name}: an int >= 0 (0: never), got {getattr(self, name)!r}")
        _flag("scorer.precise", self.precise)


@dataclass(frozen=True)
class TopkConfig:
    """The unfused top-k (``triton_topk``: radix passes; ``triton_topk_sample``: sampled threshold)."""

    algo: str = "auto"
    """"radix", "sample", "cuda_radix" (the NVRTC-compiled CUDA kernel, ``cuda_topk``, where the
    device and compiler allow it, else what "auto" picks), or "auto": "cuda_radix" where it can
    run (every call on sm_90+ with ``cuda_cluster``, else from ``cuda_min_rows`` rows up), else
    "sample" from ``sample_min_rows`` rows up, else "radix" (static counts)."""
    block: int = 1024
    """Scores per iteration."""
    warps: int = 4
    ctas_per_sm: int = 4
    max_chunks: int = 512
    """Most programs per row."""
    sample_min_rows: int = 32
    cuda_min_rows: int = 32
    """"auto": rows from which the one-CTA-per-row CUDA top-k runs, where it can and the cluster
    route cannot; 0: never."""
    cuda_cluster: bool = True
    """"cuda_radix" on sm_90+: thread-block clusters of several CTAs per row (sized by the route
    planner, ``cuda_topk.plan_cluster``), taken by "auto" for every call."""
    cap: int = 8192
    """"sample": most candidates per row."""
    sample_above: int = 4096
    """"sample": rows longer than this are sampled; shorter ones are read whole by the resolve."""
    samples: int = 2048
    """"sample": strided samples per row that set the candidate threshold."""
    resolve_block: int = 2048
    resolve_warps: int = 8
    cuda_threads: int = 1024
    """"cuda_radix": threads per CTA (one CTA per row); with ``cuda_vec``, one of
    ``cuda_topk.VARIANTS``."""
    cuda_vec: int = 4
    """"cuda_radix": float4 loads per thread and tile (rows up to ``threads * 4 * vec`` stay in
    registers)."""
    cuda_cap: int = 8192
    """"cuda_radix": keys of the threshold bin kept in shared memory (4 bytes each); a fuller
    bin re-reads the row (exact either way)."""
    cuda_lens_early: bool = True
    """"cuda_radix" cluster route in a step: the top-k reads the rows' live lengths before it
    waits for the scorer (which does not write them), their round trip beside the scorer's end."""
    scorer_counts: bool = False
    """"cuda_radix" at one CTA a row after the CUDA scorer, in a step (positions): the scorer also
    counts each row's scores into the top-k's pass-A bins (the workspace's ``counts``) and the
    top-k takes those counts instead of counting the row again. Off until measured on the GPU."""

    def __post_init__(self) -> None:
        _plain_values(self)
        if self.algo not in TOPK_ALGOS:
            raise ValueError(f"topk.algo: one of {', '.join(TOPK_ALGOS)}, got {self.algo!r}")
        for name in ("block", "samples", "resolve_block", "warps", "resolve_warps"):
            _pow2(f"topk.{name}", getattr(self, name))
        for name in ("ctas_per_sm", "max_chunks", "sample_min_rows", "cap"):
            _positive(f"topk.{name}", getattr(self, name))
        if (self.cuda_threads, self.cuda_vec) not in ((1024, 4), (1024, 2), (512, 4), (512, 8)):
            raise ValueError("topk.cuda_threads/cuda_vec: one of (1024, 4), (1024, 2), (512, 4), (512, 8), "
                             f"got {(self.cuda_threads, self.cuda_vec)!r}")
        for name in ("cuda_cluster", "cuda_lens_early", "scorer_counts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"topk.{name}: True or False, got {getattr(self, name)!r}")
        if not _is_int(self.cuda_min_rows) or self.cuda_min_rows < 0:
            raise ValueError(f"topk.cuda_min_rows: an int >= 0 (0: never), got {self.cuda_min_rows!r}")
        if not _is_int(self.cuda_cap) or not 0 <= self.cuda_cap <= 53248:
            raise ValueError(f"topk.cuda_cap: an int in [0, 53248] (shared memory), got {self.cuda_cap!r}")
        if isinstance(self.sample_above, bool) or not isinstance(self.sample_above, int) \
                or self.sample_above < 0:
            raise ValueError(f"topk.sample_above: must be an int >= 0, got {self.sample_above!r}")


@dataclass(frozen=True)
class FusedConfig:
    """The fused small-batch step (``triton_fused``): score and select in one cooperative launch."""

    enabled: bool = True
    max_rows: int = 8
    """Calls of at most this many rows take the fused route."""
    ctas_per_sm: int = 2
    """Programs per SM (all resident at once)."""
    max_parts: int = 128
    """Most programs per row: more make each row barrier slower."""
    max_keys: int = 2048
    """Most keys a program holds in registers; a wider call takes the unfused route."""
    stages: int = 6
    warps: int = 4
    resolve_block: int = 1024
    """Candidates per iteration of the row's one-program resolve."""

    def __post_init__(self) -> None:
        _plain_values(self)
        _flag("fused.enabled", self.enabled)
        for name in ("max_rows", "ctas_per_sm", "max_parts", "stages"):
            _positive(f"fused.{name}", getattr(self, name))
        for name in ("max_keys", "warps", "resolve_block"):
            _pow2(f"fused.{name}", getattr(self, name))


@dataclass(frozen=True)
class KernelConfig:
    """The launch configuration of every indexer kernel family."""

    scorer: ScorerConfig = field(default_factory=ScorerConfig)
    topk: TopkConfig = field(default_factory=TopkConfig)
    fused: FusedConfig = field(default_factory=FusedConfig)

    def __post_init__(self) -> None:
        for name, cls in (("scorer", ScorerConfig), ("topk", TopkConfig), ("fused", FusedConfig)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"{name}: must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")

    def to_dict(self) -> dict:
        """``{"scorer": {...}, "topk": {...}, "fused": {...}}``."""
        return asdict(self)

    def with_values(self, **dotted) -> KernelConfig:
        """A copy with ``family.name=value`` changes, e.g. ``with_values(**{"topk.algo": "radix"})``."""
        parts: dict[str, dict] = {}
        for key, value in dotted.items():
            family, _, name = key.partition(".")
            if family not in ("scorer", "topk", "fused") or not name:
                raise ValueError(f"config key {key!r}: expected scorer.*, topk.* or fused.*")
            known = {f.name for f in fields(getattr(self, family))}
            if name not in known:
                raise ValueError(f"config key {key!r}: {family} has {', '.join(sorted(known))}")
            parts.setdefault(family, {})[name] = value
        return replace(self, **{fam: replace(getattr(self, fam), **kv) for fam, kv in parts.items()})

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        """The inverse of ``to_dict`` (missing families and fields keep their defaults)."""
        unknown = set(data) - {"scorer", "topk", "fused"}
        if unknown:
            raise ValueError(f"config: unknown families {sorted(unknown)}")
        return cls(scorer=ScorerConfig(**data.get("scorer", {})), topk=TopkConfig(**data.get("topk", {})),
                   fused=FusedConfig(**data.get("fused", {})))


DEFAULT_CONFIG = KernelConfig()


def parse_assignments(text: str) -> dict:
    """``"topk.algo=radix,scorer.precise=false"`` -> typed values (ints, bools, strings)."""
    out: dict = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"config: expected key=value, got {item!r}")
        low = raw.strip().lower()
        if low in ("true", "false"):
            out[key.strip()] = low == "true"
        elif low.lstrip("-").isdigit():
            out[key.strip()] = int(low)
        else:
            out[key.strip()] = raw.strip()
    return out
