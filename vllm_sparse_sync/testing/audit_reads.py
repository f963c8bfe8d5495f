"""The audit's host-read counter, on the harness: every layer that can run here."""

from __future__ import annotations

from ..metadata import DecodeBatch, IndexerMetadataBuilder
from .guard import check_step


def host_reads(builder: IndexerMetadataBuilder, batch: DecodeBatch) -> tuple[int, str]:
    """(host syncs seen in one `build()`, the first one in words).

    CPU: the sentinel over the batch's device tensors and the builder's buffers. CUDA: also
    the debug mode, the runtime-API counter and the capture probe. The count is the most any
    one layer saw (layers see the same syncs).
    """
    host = [batch.query_start_loc_cpu]
    if batch.shadow is not None:
        host += [t for t in (batch.shadow.seq_lens_cpu, batch.shadow.dcp_local_seq_lens_cpu)
                 if t is not None]
    host_ptrs = {t.untyped_storage().data_ptr() for t in host}
    # on a CPU run `x.to("cpu")` may hand back the host twin itself: that one is not watched
    watch = [t for t in (batch.query_start_loc, batch.seq_lens, batch.block_table,
                         builder.row_lens_buffer, builder.block_table_buffer,
                         builder.active_width_buffer)
             if t.untyped_storage().data_ptr() not in host_ptrs]
    check = check_step(lambda: builder.build(batch), watch=watch, warmup=1, raise_on_sync=False,
                       where="audit build()")
    if not check.records:
        return 0, ""
    first = check.records[0]
    layers = ",".join(sorted(check.by_layer))
    return max(check.by_layer.values()), f"{first.op} at {first.location}: {first.code} [{layers}]"
