"""The audit's host-read counter, on the harness: every layer that can run here."""

from __future__ import annotations

from ..metadata import DecodeBatch, IndexerMetadataBuilder
from .guard import check_step
from .watch import device_tensors


def host_reads(builder: IndexerMetadataBuilder, batch: DecodeBatch) -> tuple[int, str]:
    """(host syncs seen in one `build()`, the first one in words).

    CPU: the sentinel over every device-standing tensor of the batch and the builder (a
    stand-in that shares storage with its host twin is an error). CUDA: also the debug mode,
    the runtime-API counter and the capture probe. The count is the most any one layer saw
    (layers see the same syncs). A sentinel that saw no watched tensor in use counts as a
    failed check: the audit would otherwise pass on nothing.
    """
    watch = device_tensors(builder, batch, strict=True)
    check = check_step(lambda: builder.build(batch), watch=watch, warmup=1, raise_on_sync=False,
                       where="audit build()")
    if check.touched == 0:
        return 1, "vacuous check: build() used none of the watched device tensors"
    if not check.records:
        return 0, ""
    first = check.records[0]
    layers = ",".join(sorted(check.by_layer))
    return max(check.by_layer.values()), f"{first.op} at {first.location}: {first.code} [{layers}]"
