"""The CUDA wgmma scorer on a CPU host: its operand layouts emulated in torch (the query's image in
shared memory, each thread's key bytes, the wgmma fragments, as ``scorer.cu`` indexes them)
give q . k for every (token, head); the planner's scorer choice; the calls ``takes`` accepts; and
an NVRTC compile for sm_90a that fits its CTA per SM without spills (skipped, with the reason,
where NVRTC is absent)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_sparse_sync.kernels.cuda import scorer as cuda_scorer
from vllm_sparse_sync.kernels.cuda import topk as cuda_topk
from vllm_sparse_sync.kernels import planner
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG, KernelConfig
from vllm_sparse_sync.kernels.planner import CUDA, TRITON, DeviceInfo, plan_route, scorer_for

LBO, SBO = 128, 256  # the kernel's b_desc: K-adjacent and N-adjacent core matrices


def q_image(q: torch.Tensor, precise: bool) -> torch.Tensor:
    """The kernel's B operand image of ``q`` ``[H, 128]`` (element values; f16 or e4m3 slots)."""
    heads = q.shape[0]
    esize = 2 if precise else 1
    img = torch.full((heads * 128 * esize // esize,), float("nan"), dtype=torch.float64)
    step_bytes = heads * 32
    for h in range(heads):
        for p in range(0, 128, 4):
            c = p // 32
            core = (h // 8) * SBO + (h % 8) * 16
            if precise:
                j = (p % 32) // 4
                base = j * step_bytes + core
                for e in range(2):  # dims p, p+1 -> kl 2c + e; p+2, p+3 -> kl 2c + 8 + e
                    img[(base + (2 * c) * 2 + 2 * e) // 2] = q[h, p + e]
                    img[(base + LBO + (2 * c) * 2 + 2 * e) // 2] = q[h, p + 2 + e]
            else:
                j, hi = (p % 32) // 8, (p % 8) // 4
                for e in range(4):
                    img[j * step_bytes + core + hi * LBO + 4 * c + e] = q[h, p + e]
    assert not torch.isnan(img).any()  # every slot written once
    return img


def b_matrix(img: torch.Tensor, j: int, heads: int, precise: bool) -> torch.Tensor:
    """``B[kl, n]`` of k-step ``j`` as wgmma reads a K-major, unswizzled descriptor."""
    ksize = 16 if precise else 32
    esize = 2 if precise else 1
    step = heads * 32
    b = torch.empty(ksize, heads, dtype=torch.float64)
    per_core = 16 // esize  # K elements in one core-matrix row
    for kl in range(ksize):
        for n in range(heads):
            byte = j * step + (n // 8) * SBO + (kl // per_core) * LBO + (n % 8) * 16 + (kl % per_core) * esize
            b[kl, n] = img[byte // esize]
    return b


def a_matrix(keys: torch.Tensor, j: int, precise: bool) -> torch.Tensor:
    """``A[m, kl]`` of k-step ``j`` (64 tokens) from each thread's registers, as the kernel fills them."""
    ksize = 16 if precise else 32
    a = torch.full((64, ksize), float("nan"), dtype=torch.float64)
    for tid in range(128):
        lane, warp = tid % 32, tid // 32
        g, c = lane // 4, lane % 4
        m0 = warp * 16 + g
        rows = {0: m0, 1: m0 + 8}
        own = {r: keys[m, 32 * c: 32 * c + 32] for r, m in rows.items()}  # 32 bytes of each row
        if precise:  # a0/a1: row m0/m0+8 at kl 2c, 2c+1 <- bytes 4j, 4j+1; a2/a3: kl 2c+8.. <- 4j+2..
            for r, m in rows.items():
                for e in range(2):
                    a[m, 2 * c + e] = own[r][4 * j + e]
                    a[m, 2 * c + 8 + e] = own[r][4 * j + 2 + e]
        else:  # a0/a1: kl 4c.. <- word 2j; a2/a3: kl 16 + 4c.. <- word 2j + 1
            for r, m in rows.items():
                for e in range(4):
                    a[m, 4 * c + e] = own[r][8 * j + e]
                    a[m, 16 + 4 * c + e] = own[r][8 * j + 4 + e]
    assert not torch.isnan(a).any()
    return a


@pytest.mark.parametrize("precise", [True, False])
@pytest.mark.parametrize("heads", [64, 32])
def test_the_operand_layouts_compute_q_dot_k(precise, heads):
    g = torch.Generator().manual_seed(heads + precise)
    q = torch.randint(-8, 9, (heads, 128), generator=g).double()
    keys = torch.randint(-8, 9, (64, 128), generator=g).double()
    img = q_image(q, precise)
    d = torch.zeros(64, heads, dtype=torch.float64)
    for j in range(8 if precise else 4):
        d += a_matrix(keys, j, precise) @ b_matrix(img, j, heads, precise)
    assert torch.equal(d, keys @ q.T)


def test_the_planner_takes_the_cuda_scorer_where_the_device_can(monkeypatch):
    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=200000, cuda_scorer=True)
    assert plan_route(64, 65536, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).score_splits == 132 * planner.CUDA_SCORER_CTAS_PER_SM // 8
    assert plan_route(7, 2048, 64, hopper).scorer == TRITON  # fewer rows than CUDA_SCORER_MIN_ROWS
    assert plan_route(7, 2048, 64, hopper).score_splits == 132 * planner.TRITON_SCORER_CTAS_PER_SM // 7
    # any row count from a bound of CUDA_SCORER_MIN_WIDTH
    width = planner.CUDA_SCORER_MIN_WIDTH
    for rows in (1, 2, 4, 7):
        assert plan_route(rows, width, 64, hopper).scorer == CUDA
        assert plan_route(rows, width - 64, 64, hopper).scorer == TRITON
    assert plan_route(1, 131072, 64, hopper).score_splits == 132 * planner.CUDA_SCORER_CTAS_PER_SM
    monkeypatch.setattr(planner, "CUDA_SCORER_MIN_ROWS", 0)  # every call, read when a plan is made
    assert plan_route(2, 1024, 64, hopper).scorer == CUDA
    assert plan_route(64, 65536, 32, hopper).scorer == TRITON  # pages of another size
    assert plan_route(64, 65536, 64, DeviceInfo(num_sms=132)).scorer == TRITON
    off, fp8 = KernelConfig(cuda=False), KernelConfig(precise=False)  # fp8 with no width: too small
    assert scorer_for(64, 64, hopper, off) == TRITON and scorer_for(64, 64, hopper) == CUDA
    assert scorer_for(64, 64, hopper, fp8) == TRITON


def test_the_e4m3_path_takes_the_cuda_scorer_from_its_own_size():
    """``CUDA_FP8_SCORER_MIN_TOKENS`` (rows x width bound) chooses the CUDA kernel for the e4m3
    path; the exact path's thresholds never do."""
    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=200000, cuda_scorer=True)
    e4m3 = KernelConfig(precise=False)
    tokens = planner.CUDA_FP8_SCORER_MIN_TOKENS
    for rows, width in ((64, 65536), (128, 8192), (8, 65536), (1, 65536), (4, 16384), (1, tokens),
                        (2, tokens // 2)):
        assert scorer_for(rows, 64, hopper, e4m3, width) == CUDA
    for rows, width in ((1, tokens - 1), (1, tokens // 2), (7, 64)):
        assert scorer_for(rows, 64, hopper, e4m3, width) == TRITON
        assert scorer_for(rows, 64, hopper, DEFAULT_CONFIG, width) == (  # the exact path's own rule
            CUDA if rows >= planner.CUDA_SCORER_MIN_ROWS or width >= planner.CUDA_SCORER_MIN_WIDTH else TRITON)
    assert plan_route(1, 65536, 64, hopper, e4m3).score_splits == 132 * planner.CUDA_SCORER_CTAS_PER_SM
    # never where the kernel cannot run, the pages do not fit or the CUDA routes are off
    assert scorer_for(1, 64, DeviceInfo(num_sms=132), e4m3, 65536) == TRITON
    assert scorer_for(1, 32, hopper, e4m3, 65536) == TRITON
    assert scorer_for(1, 64, hopper, e4m3.with_values(cuda=False), 65536) == TRITON


def test_takes_only_the_calls_the_kernel_is_built_for():
    cache = torch.zeros(10, 64 * 132, dtype=torch.uint8)
    q = torch.zeros(2, 64, 128, dtype=torch.uint8)
    table = torch.zeros(2, 4, dtype=torch.int32)
    assert cuda_scorer.takes(q, cache, table, 64, 8)
    assert not cuda_scorer.takes(torch.zeros(2, 16, 128, dtype=torch.uint8), cache, table, 64, 8)  # heads
    assert not cuda_scorer.takes(q, torch.zeros(10, 32 * 132, dtype=torch.uint8), table, 32, 8)  # page
    assert not cuda_scorer.takes(q, cache[:, 4:], table, 64, 8)  # a page not 16-byte aligned
    assert not cuda_scorer.takes(q, cache, table.t().contiguous().t(), 64, 8)  # table rows not contiguous
    assert not cuda_scorer.takes(q, cache, table, 64, 70000)  # more splits than the grid's y
    with pytest.raises(ValueError, match="heads"):
        cuda_scorer.kernel_name(16, True)


def test_the_ctas_of_the_grid_fit_one_sm():
    """An SM's 227 KB of opt-in shared memory (1 KB reserved per CTA) holds the grid's CTAs per
    SM of either path, the source's ring and warpgroups are the module's, and the grid asks for
    what the kernel's shared memory allows."""
    assert planner.CUDA_SCORER_CTAS_PER_SM == cuda_scorer.CTAS_PER_SM
    assert f"#define CONSUMERS {cuda_scorer.CONSUMERS}" in cuda_scorer.source()
    assert f"#define STAGES_DEEP {cuda_scorer.STAGES_DEEP} " in cuda_scorer.source()
    assert f"#define STAGES_SHORT {cuda_scorer.STAGES_SHORT} " in cuda_scorer.source()
    assert cuda_scorer.THREADS == 128 * cuda_scorer.CONSUMERS + 32
    assert cuda_scorer.threads_for(3) == 416  # a variant build of 3 consumers: its own launch
    for heads in cuda_scorer.HEADS:
        for precise in (True, False):
            for stages in (cuda_scorer.STAGES_DEEP, cuda_scorer.STAGES_SHORT):
                assert stages % cuda_scorer.CONSUMERS == 0
                smem = cuda_scorer.smem_bytes(heads, precise, stages)
                assert cuda_scorer.CTAS_PER_SM * (smem + 1024) <= 228 * 1024
    # one more slot per consumer would not fit: the ring is as deep as the SM allows
    deeper = cuda_scorer.STAGES_DEEP + cuda_scorer.CONSUMERS
    assert cuda_scorer.smem_bytes(64, True, deeper) + 1024 > 228 * 1024


NVRTC_OK, NVRTC_WHY = cuda_topk.compiler_status()


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_the_source_compiles_for_sm90a_without_spills():
    """The build compiles without spills, in the registers its CTA per SM leaves each thread."""
    consumers = cuda_scorer.CONSUMERS
    text = cuda_scorer.source()
    _, log = cuda_topk.compile_source(cuda_scorer.ARCH, text=text, name="scorer.cu",
                                      extra_options=("--ptxas-options=-v",))
    found = re.findall(r"entry function '(\w+)'.*?(\d+) bytes spill stores.*?Used (\d+) registers", log, re.S)
    names = {f[0] for f in found}
    assert names == {cuda_scorer.kernel_name(h, p, s) for h in cuda_scorer.HEADS for p in (True, False)
                     for s in (cuda_scorer.STAGES_DEEP, cuda_scorer.STAGES_SHORT)}
    for name, spills, regs in found:
        assert int(spills) == 0, (name, spills)
        # CTAS_PER_SM CTAs of THREADS threads per SM: each of the SM's four sub-partitions
        # holds its share of the warps in 16K registers
        warps = cuda_scorer.CTAS_PER_SM * cuda_scorer.threads_for(consumers) // 32
        assert int(regs) * 32 * -(-warps // 4) <= 16384, (name, regs)


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_the_default_build_copies_pages_evict_first():
    """The library's build is the one whose page copies carry the L2 evict-first policy
    (KEYS_EVICT_FIRST=1: the logits stay in L2 for the top-k), not the plain copy's
    (KEYS_EVICT_FIRST=0)."""
    default, _ = cuda_scorer.build_cubin(())
    assert default == cuda_scorer.build_cubin((("KEYS_EVICT_FIRST", 1),))[0]
    assert default != cuda_scorer.build_cubin((("KEYS_EVICT_FIRST", 0),))[0]


def test_the_variant_tool_launches_the_library_source_as_the_module_does():
    """tools/cuda_scorer_variants.py: a variant spec parses (a malformed one is refused by
    name), and the library source's launch geometry read from its macros is the module's."""
    from scripts import load_script

    tool = load_script("cuda_scorer_variants")
    v = tool.parse_variant("c5=@12:CONSUMERS=5,STAGES_SHORT=20")
    assert (v.name, v.path, v.defines, v.stages) == ("c5", "", {"CONSUMERS": 5, "STAGES_SHORT": 20}, 12)
    # the ring launched: @S/N (N live tiles for every slot), @S (every slot), none (the library's)
    assert tool.launch_ring(tool.parse_variant("rt=@24/384")) == (24, 384)
    assert tool.launch_ring(tool.parse_variant("d=x.cu@24:CONSUMERS=4")) == (24, 0)
    assert tool.launch_ring(tool.parse_variant("old=x.cu")) == (None, cuda_scorer.NEVER_DEEP)
    for bad in ("noequals", "x=:CONSUMERS", "x=:lower=3", "x=:STAGES=two", "x=@deep", "x=@24/many",
                "x=@/3", "triton=@12"):
        with pytest.raises(ValueError, match="variant"):
            tool.parse_variant(bad)
    text = cuda_scorer.source()
    for heads in cuda_scorer.HEADS:
        for stages in (cuda_scorer.STAGES_DEEP, cuda_scorer.STAGES_SHORT):
            got = tool.geometry(text, tool.parse_variant(f"x=@{stages}"), heads)
            assert got == (cuda_scorer.kernel_name(heads, True, stages), cuda_scorer.THREADS,
                           cuda_scorer.smem_bytes(heads, True, stages), 1)
    assert tool.geometry(text, tool.parse_variant("x="), 64)[0] == cuda_scorer.kernel_name(64, True)
    name, threads, smem, _ = tool.geometry(text, tool.parse_variant("x=:CONSUMERS=3,STAGES_SHORT=9"), 64)
    assert (name, threads, smem) == ("score_h64_p1_s9", 3 * 128 + 32, cuda_scorer.smem_bytes(64, True, 9))
    # rounds: each variant once a round, each first in one round of every len(variants)
    orders = tool.round_orders(3, 4)
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert all(sorted(o) == [0, 1, 2] for o in orders) and {o[0] for o in orders[:3]} == {0, 1, 2}
    with pytest.raises(ValueError, match="rounds"):
        tool.round_orders(2, 0)
    padded = tool.geometry(text, tool.parse_variant("x=@12:SMEM_PAD=4096"), 64)[2]
    assert padded == cuda_scorer.smem_bytes(64, True, 12) + 4096
    assert tool.geometry(text, tool.parse_variant("x=:CONSUMERS=2,CTAS_PER_SM=2"), 64)[1:] == (
        288, cuda_scorer.smem_bytes(64, True), 2)  # the grid sized for 2 CTAs an SM


def test_the_ring_is_chosen_on_the_device_not_by_the_bound(monkeypatch):
    """``ring``: the launch's kernel and ``deep_tiles`` come from module constants alone (no
    argument: the host bound cannot choose); the kernel picks the ring per program from its live
    tiles (its source compares them with ``deep_tiles``). None: the short-ring kernel, never deep;
    a bad ``DEEP_TILES`` is refused by name."""
    import inspect

    deep, short = cuda_scorer.STAGES_DEEP, cuda_scorer.STAGES_SHORT
    assert not inspect.signature(cuda_scorer.ring).parameters
    assert "my_tiles >= deep_tiles ? STAGES : SHORT" in cuda_scorer.source()
    default = cuda_scorer.DEEP_TILES
    assert cuda_scorer.ring() == ((short, cuda_scorer.NEVER_DEEP) if default is None else (deep, default))
    monkeypatch.setattr(cuda_scorer, "DEEP_TILES", None)
    assert cuda_scorer.ring() == (short, 2**31 - 1)
    monkeypatch.setattr(cuda_scorer, "DEEP_TILES", 0)
    assert cuda_scorer.ring() == (deep, 0)
    for bad in (-1, 2**31, 3.0, True, "384"):
        monkeypatch.setattr(cuda_scorer, "DEEP_TILES", bad)
        with pytest.raises(ValueError, match="DEEP_TILES"):
            cuda_scorer.ring()
    assert cuda_scorer.kernel_name(64, True, short) != cuda_scorer.kernel_name(64, True, deep)
    with pytest.raises(ValueError, match="stages"):
        cuda_scorer.kernel_name(64, True, 7)


def _code(text: str) -> str:
    """``text`` without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _function_body(src: str, signature: str) -> str:
    """The code of the function that ``signature`` opens, from its body's first brace on."""
    start = src.index(signature)
    return _code(src[src.index(") {", start) + 3:])


def test_the_scorer_waits_for_the_previous_kernel_before_any_global_access():
    """A dependent launch of the scorer (``KernelConfig.pdl``) may start while the kernel ahead of it
    runs: every CTA waits for it (``griddepcontrol.wait``, compiled in by default) before it
    touches any pointer it was given, and only then lets its own dependents launch, so the top-k's
    live lengths read before its own wait (``lens_early``) see every earlier kernel's writes."""
    src = cuda_scorer.source()
    assert re.search(r"^#define PDL_WAIT 1\b", src, flags=re.M)
    body = _function_body(src, "__device__ __forceinline__ void score_row(")
    wait = body.index("griddepcontrol.wait")
    assert body.count("griddepcontrol.wait") == 1
    assert wait < body.index("griddepcontrol.launch_dependents")
    before = set(re.findall(r"[A-Za-z_]\w*", body[:wait]))
    pointers = {"q", "w", "kc", "bt", "lens", "active", "out", "load_int", "bulk_copy"}
    assert not before & pointers, f"used before the wait: {sorted(before & pointers)}"
    assert KernelConfig().pdl is True
    with pytest.raises(TypeError, match="config.pdl"):
        KernelConfig(pdl=1)


def test_the_top_k_lets_the_next_kernel_launch_once_its_own_wait_is_over():
    """The cluster top-k lets its dependents launch (the next step's scorer, a dependent launch
    that waits for it) by default, as soon as every kernel before it has completed: after its own
    wait, never before it, so a dependent never starts ahead of the kernels before the top-k."""
    src = cuda_topk.source()
    assert re.search(r"^#define TOPK_TRIGGER 1\b", src, flags=re.M)
    body = _function_body(src, "__device__ __forceinline__ void topk_cluster_row(")
    assert body.count("griddepcontrol.launch_dependents") == 1
    assert body.index("grid_dependency_wait()") < body.index("griddepcontrol.launch_dependents")


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_the_dependent_launch_attribute_is_programmatic_stream_serialization():
    """Both modules' ``pdl`` launches carry the attribute that lets them start before the previous
    kernel completes (built from the driver bindings alone, no GPU)."""
    driver, _ = cuda_topk._bindings()
    attr = cuda_topk.pdl_launch_attribute(driver)
    assert attr.id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1
