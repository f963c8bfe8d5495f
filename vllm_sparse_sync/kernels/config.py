"""The kernel choices a user makes: exact or e4m3 scores, CUDA or Triton, the top-k, the fused
step, dependent launches. Everything else is the planner's (``planner``'s named constants)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

TOPK_CHOICES = ("auto", "radix", "sample", "cuda")


@dataclass(frozen=True)
class KernelConfig:
    """What the indexer kernels may do; the planner picks the rest from the call and the device."""

    precise: bool = True
    """Exact scores (e4m3 products in fp16, fp32 sums: the reference's numerics); False: the fp8
    tensor-core dot (DeepGEMM's numerics, about 1e-3 relative error, faster at large batches)."""
    cuda: bool = True
    """Let the NVRTC-compiled CUDA scorer and top-k run where the device and NVRTC allow; False:
    the Triton kernels only (an image without NVRTC, or to compare)."""
    topk: str = "auto"
    """The unfused top-k: ``"auto"`` (the planner's), or pinned to ``"radix"``, ``"sample"`` or
    ``"cuda"`` (the CUDA top-k where the device runs it, else the planner's Triton choice) to
    bisect a problem to one algorithm; with ``fused=False`` every call takes it."""
    fused: bool = True
    """Let calls of few rows take the fused Triton step (one cooperative launch whose programs wait
    for each other) where the cluster top-k cannot run; False on a GPU shared with other work
    (MPS), where a cooperative grid is not sure to be resident."""
    pdl: bool = True
    """Programmatic dependent launches between the step's kernels (sm_90+): the next kernel starts
    its setup while the previous one ends; False to profile each kernel on its own."""

    def __post_init__(self) -> None:
        from ..checks import flag

        for name in ("precise", "cuda", "fused", "pdl"):  # (a numpy bool is stored as a bool)
            object.__setattr__(self, name, flag(f"config.{name}", getattr(self, name)))
        if self.topk not in TOPK_CHOICES:
            raise ValueError(f"config.topk: one of {', '.join(TOPK_CHOICES)}, got {self.topk!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KernelConfig:
        """The inverse of ``to_dict`` (missing fields keep their defaults)."""
        if not isinstance(data, dict):
            raise TypeError(f"config: must be a dict, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"config: unknown fields {sorted(unknown)}; fields: {', '.join(FIELDS)}")
        return cls(**data)

    def with_values(self, **values) -> KernelConfig:
        """A copy with some fields changed, e.g. ``with_values(topk="radix")``."""
        unknown = set(values) - set(FIELDS)
        if unknown:
            raise ValueError(f"config: unknown fields {sorted(unknown)}; fields: {', '.join(FIELDS)}")
        return replace(self, **values)


FIELDS = tuple(f.name for f in fields(KernelConfig))
DEFAULT_CONFIG = KernelConfig()


def parse_config(text: str, base: KernelConfig = DEFAULT_CONFIG) -> KernelConfig:
    """``"precise=false,topk=radix"`` -> ``base`` with those fields (``true``/``false`` for flags)."""
    values: dict = {}
    for item in (s.strip() for s in text.split(",") if s.strip()):
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise ValueError(f"config: expected field=value, got {item!r}")
        if key not in FIELDS:
            raise ValueError(f"config: unknown field {key!r}; fields: {', '.join(FIELDS)}")
        if key == "topk":
            values[key] = raw
        elif raw.lower() in ("true", "false"):
            values[key] = raw.lower() == "true"
        else:
            raise ValueError(f"config: {key} takes true or false, got {raw!r}")
    return base.with_values(**values)
