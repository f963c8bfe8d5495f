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
from vllm_sparse_sync.kernels.config import DEFAULT_CONFIG, ScorerConfig
from vllm_sparse_sync.kernels.route import CUDA, TRITON, DeviceInfo, plan_route, scorer_for

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


def test_the_planner_takes_the_cuda_scorer_where_the_device_can():
    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=200000, cuda_scorer=True)
    assert plan_route(64, 65536, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).scorer == CUDA
    assert plan_route(8, 4096, 64, hopper).score_splits == 132 * DEFAULT_CONFIG.scorer.cuda_ctas_per_sm // 8
    assert plan_route(7, 2048, 64, hopper).scorer == TRITON  # fewer rows than scorer.cuda_min_rows
    assert plan_route(7, 2048, 64, hopper).score_splits == 132 * DEFAULT_CONFIG.scorer.ctas_per_sm // 7
    every = DEFAULT_CONFIG.with_values(**{"scorer.cuda_min_rows": 0})
    assert plan_route(2, 1024, 64, hopper, every).scorer == CUDA
    # the defaults: any row count from a bound of 4K (runs 90-94, 167)
    assert DEFAULT_CONFIG.scorer.cuda_min_width == DEFAULT_CONFIG.scorer.cuda_one_row_min_width == 4096
    for rows in (1, 2, 4, 7):
        assert plan_route(rows, 4096, 64, hopper).scorer == CUDA
        assert plan_route(rows, 4032, 64, hopper).scorer == TRITON
    # fewer rows take it from a bound of scorer.cuda_min_width up (0: never by width)
    cfg = DEFAULT_CONFIG.with_values(**{"scorer.cuda_min_width": 32768,
                                        "scorer.cuda_one_row_min_width": 4096})
    wide = cfg.scorer.cuda_min_width
    assert plan_route(2, wide, 64, hopper, cfg).scorer == CUDA
    assert plan_route(7, 131072, 64, hopper, cfg).scorer == CUDA
    assert plan_route(1, 131072, 64, hopper, cfg).score_splits == 132 * cfg.scorer.cuda_ctas_per_sm
    assert plan_route(2, wide - 1, 64, hopper, cfg).scorer == TRITON
    # one row from scorer.cuda_one_row_min_width up (0: only from cuda_min_width)
    one = cfg.scorer.cuda_one_row_min_width
    assert plan_route(1, one, 64, hopper, cfg).scorer == CUDA
    assert plan_route(1, one, 64, hopper, cfg).score_splits == 132 * cfg.scorer.cuda_ctas_per_sm
    assert plan_route(1, one - 1, 64, hopper, cfg).scorer == TRITON
    assert plan_route(2, one, 64, hopper, cfg).scorer == TRITON
    by_wide = cfg.with_values(**{"scorer.cuda_one_row_min_width": 0})
    assert plan_route(1, one, 64, hopper, by_wide).scorer == TRITON
    assert plan_route(1, wide, 64, hopper, by_wide).scorer == CUDA
    by_rows = by_wide.with_values(**{"scorer.cuda_min_width": 0})
    assert plan_route(1, 131072, 64, hopper, by_rows).scorer == TRITON
    assert plan_route(8, 4096, 64, hopper, by_rows).scorer == CUDA
    for name in ("cuda_min_width", "cuda_one_row_min_width"):
        with pytest.raises(ValueError, match=name):
            DEFAULT_CONFIG.with_values(**{f"scorer.{name}": -1})
    assert plan_route(64, 65536, 32, hopper).scorer == TRITON  # pages of another size
    assert plan_route(64, 65536, 64, DeviceInfo(num_sms=132)).scorer == TRITON
    off = DEFAULT_CONFIG.with_values(**{"scorer.cuda": False})
    fp8 = DEFAULT_CONFIG.with_values(**{"scorer.precise": False})  # no width: under cuda_fp8_min_tokens
    assert scorer_for(64, 64, hopper, off) == TRITON and scorer_for(64, 64, hopper) == CUDA
    assert scorer_for(64, 64, hopper, fp8) == TRITON


def test_the_e4m3_path_takes_the_cuda_scorer_only_where_asked():
    """``scorer.cuda_fp8_min_tokens`` (rows x width bound) and ``scorer.cuda_fp8_one_row_min_width``
    choose the CUDA kernel for the e4m3 path; the exact path's own thresholds never do."""
    hopper = DeviceInfo(num_sms=132, cuda_topk=True, cluster_smem=200000, cuda_scorer=True)
    fp8 = DEFAULT_CONFIG.with_values(**{"scorer.precise": False, "scorer.cuda_fp8_min_tokens": 0,
                                        "scorer.cuda_fp8_one_row_min_width": 0})
    for rows, width in ((1, 4096), (1, 131072), (8, 65536), (64, 65536), (128, 8192)):
        assert scorer_for(rows, 64, hopper, fp8, width) == TRITON
        # the exact path's thresholds take these calls
        assert scorer_for(rows, 64, hopper, DEFAULT_CONFIG, width) == CUDA
    by_size = fp8.with_values(**{"scorer.cuda_fp8_min_tokens": 64 * 65536})
    assert scorer_for(64, 64, hopper, by_size, 65536) == CUDA
    assert scorer_for(32, 64, hopper, by_size, 131072) == CUDA
    assert scorer_for(64, 64, hopper, by_size, 65535) == TRITON
    assert scorer_for(1, 64, hopper, by_size, 131072) == TRITON
    one = fp8.with_values(**{"scorer.cuda_fp8_one_row_min_width": 32768})
    assert scorer_for(1, 64, hopper, one, 32768) == CUDA
    assert scorer_for(1, 64, hopper, one, 32767) == TRITON
    assert scorer_for(2, 64, hopper, one, 131072) == TRITON
    assert plan_route(1, 65536, 64, hopper, one).scorer == CUDA
    assert plan_route(1, 65536, 64, hopper, one).score_splits == 132 * DEFAULT_CONFIG.scorer.cuda_ctas_per_sm
    # never where the kernel cannot run or is switched off
    assert scorer_for(1, 64, DeviceInfo(num_sms=132), one, 65536) == TRITON
    assert scorer_for(1, 32, hopper, one, 65536) == TRITON
    assert scorer_for(1, 64, hopper, one.with_values(**{"scorer.cuda": False}), 65536) == TRITON
    # the defaults: from 4K rows x width tokens (runs 156, 157, 165, 166), one row of 4K included
    e4m3 = DEFAULT_CONFIG.with_values(**{"scorer.precise": False})
    assert scorer_for(64, 64, hopper, e4m3, 65536) == CUDA
    assert scorer_for(128, 64, hopper, e4m3, 8192) == CUDA
    assert scorer_for(8, 64, hopper, e4m3, 65536) == CUDA
    assert scorer_for(1, 64, hopper, e4m3, 65536) == CUDA
    assert scorer_for(4, 64, hopper, e4m3, 16384) == CUDA
    assert scorer_for(1, 64, hopper, e4m3, 32768) == CUDA
    assert scorer_for(1, 64, hopper, e4m3, 4096) == CUDA
    assert scorer_for(2, 64, hopper, e4m3, 2048) == CUDA
    assert scorer_for(1, 64, hopper, e4m3, 4095) == TRITON
    assert scorer_for(1, 64, hopper, e4m3, 2048) == TRITON
    for name in ("cuda_fp8_min_tokens", "cuda_fp8_one_row_min_width"):
        with pytest.raises(ValueError, match=name):
            DEFAULT_CONFIG.with_values(**{f"scorer.{name}": -1})


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
    assert DEFAULT_CONFIG.scorer.cuda_ctas_per_sm == cuda_scorer.CTAS_PER_SM
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
@pytest.mark.parametrize("counts", [False, True], ids=["plain", "counts"])
@pytest.mark.parametrize("consumers", [cuda_scorer.CONSUMERS, cuda_scorer.NARROW_CONSUMERS])
def test_the_source_compiles_for_sm90a_without_spills(consumers, counts):
    """Both builds (the default and the narrow one), and each one's counts build, compile without
    spills, in the registers their CTA per SM leaves each thread."""
    defines = cuda_scorer.build_defines(consumers, counts)
    text = "".join(f"#define {k} {v}\n" for k, v in defines) + cuda_scorer.source()
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
    (KEYS_EVICT_FIRST=1: the logits stay in L2 for the top-k, benchmarks/NOTES.md run 154), not
    the plain copy's (KEYS_EVICT_FIRST=0)."""
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


def test_the_build_follows_the_row_count_not_the_bound():
    """``consumers_for``: calls of 1 .. ``scorer.cuda_narrow_rows`` rows run the narrow build, every
    other call (and every call where it is 0) the default one; nothing of the width bound enters.
    Its macros, and a bad count refused by name; the config refuses a bad ``cuda_narrow_rows``."""
    import inspect

    from vllm_sparse_sync.kernels.config import ScorerConfig

    narrow, full = cuda_scorer.NARROW_CONSUMERS, cuda_scorer.CONSUMERS
    assert narrow < full
    assert list(inspect.signature(cuda_scorer.consumers_for).parameters) == ["rows", "narrow_rows"]
    assert DEFAULT_CONFIG.scorer.cuda_narrow_rows == 0  # opt-in until its hang is understood
    assert [cuda_scorer.consumers_for(r, 1) for r in (1, 2, 8, 132)] == [narrow, full, full, full]
    assert [cuda_scorer.consumers_for(r, 4) for r in (1, 4, 5)] == [narrow, narrow, full]
    assert [cuda_scorer.consumers_for(r, 0) for r in (1, 2)] == [full, full]
    assert cuda_scorer.build_defines(full) == ()
    assert cuda_scorer.build_defines(narrow) == (("CONSUMERS", narrow),)
    assert cuda_scorer.threads_for(narrow) == 288
    with pytest.raises(ValueError, match="consumers"):
        cuda_scorer.build_defines(3)
    for bad in (-1, 1.0, True, "1"):
        with pytest.raises(ValueError, match="cuda_narrow_rows"):
            ScorerConfig(cuda_narrow_rows=bad)
    # the narrow build's ring: each consumer owns whole slots of both rings
    for stages in (cuda_scorer.STAGES_DEEP, cuda_scorer.STAGES_SHORT):
        assert stages % narrow == 0


@pytest.mark.parametrize("rows, narrow_rows, consumers", [(1, 1, 2), (2, 1, 4), (1, 0, 4), (3, 4, 2)])
def test_the_launch_takes_the_build_of_its_row_count(monkeypatch, rows, narrow_rows, consumers):
    """``launch_cuda_score`` without a module launches the build ``consumers_for`` names, with that
    build's threads, on the same grid; a module passed in is used as is (CPU: the compile and the
    launch are stand-ins that record what they are given)."""
    from vllm_sparse_sync.kernels.config import ScorerConfig

    built, launched = [], []

    class FakeModule:
        def __init__(self, defines):
            self.threads = cuda_scorer.threads_for(dict(defines).get("CONSUMERS", cuda_scorer.CONSUMERS))

        def function(self, heads, precise, stages):
            return (heads, precise, stages)

    def fake_module_for(index, defines=()):
        built.append(tuple(defines))
        return FakeModule(defines)

    monkeypatch.setattr(cuda_scorer, "module_for", fake_module_for)
    monkeypatch.setattr(cuda_scorer, "_index", lambda device: 0)
    monkeypatch.setattr(cuda_topk, "launch_values",
                        lambda mod, fn, grid, threads, smem, values, device, *, pdl:
                        launched.append((grid, threads, pdl)))
    q = torch.zeros(rows, 64, 128, dtype=torch.uint8)
    w = torch.zeros(rows, 64)
    cache = torch.zeros(4, cuda_scorer.SLOT_BYTES, dtype=torch.uint8)
    table = torch.zeros(rows, 2, dtype=torch.int32)
    lens = torch.zeros(rows, dtype=torch.int32)
    out = torch.zeros(rows, 128)
    pdl = rows % 2 == 1  # the scorer.pdl flag reaches the launch either way
    cfg = ScorerConfig(cuda_narrow_rows=narrow_rows, pdl=pdl)
    args = (q, w, cache, table, lens, None, out)
    cuda_scorer.launch_cuda_score(*args, page_size=64, sel_width=128, fill_width=0, splits=5, config=cfg)
    assert built == [cuda_scorer.build_defines(consumers)]
    assert launched == [((rows, 5, 1), cuda_scorer.threads_for(consumers), pdl)]
    given = FakeModule(())
    cuda_scorer.launch_cuda_score(*args, page_size=64, sel_width=128, fill_width=0, splits=5, config=cfg,
                                  module=given)
    assert len(built) == 1 and launched[-1] == ((rows, 5, 1), cuda_scorer.THREADS, pdl)


def _code(text: str) -> str:
    """``text`` without its comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def _function_body(src: str, signature: str) -> str:
    """The code of the function that ``signature`` opens, from its body's first brace on."""
    start = src.index(signature)
    return _code(src[src.index(") {", start) + 3:])


def test_the_scorer_waits_for_the_previous_kernel_before_any_global_access():
    """A dependent launch of the scorer (``scorer.pdl``) may start while the kernel ahead of it
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
    assert ScorerConfig().pdl is True
    with pytest.raises(TypeError, match="scorer.pdl"):
        ScorerConfig(pdl=1)


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


@pytest.mark.skipif(not NVRTC_OK, reason=f"NVRTC unavailable: {NVRTC_WHY}")
def test_only_the_counts_build_counts_and_it_takes_two_more_parameters():
    """``SCORER_COUNTS=1`` adds a global atomic add per written score (the row's pass-A count)
    and the counts' pointer and row stride to every entry; the plain build has neither."""
    def ptx(defines):
        text = "".join(f"#define {k} {v}\n" for k, v in defines) + cuda_scorer.source()
        code, _ = cuda_topk.compile_source(cuda_scorer.ARCH, output="ptx", text=text, name="scorer.cu")
        return code.decode(errors="replace")

    plain, counted = ptx(cuda_scorer.build_defines(4)), ptx(cuda_scorer.build_defines(4, counts=True))
    entries = re.compile(r"\.entry (score_\w+)\((.*?)\)", re.S)
    params = {name: body.count(".param") for name, body in entries.findall(plain)}
    assert params and {name: body.count(".param") for name, body in entries.findall(counted)} == {
        name: n + 2 for name, n in params.items()}
    atomics = re.compile(r"(?:red|atom)\.global\.add\.u32")
    assert not atomics.search(plain)
    assert len(atomics.findall(counted)) == len(params)  # one site an entry: store_scores


def test_the_counts_reach_the_counts_build_and_its_launch(monkeypatch):
    """``launch_cuda_score(counts=...)`` checks the counts, loads the counts build of the call's
    row count and passes the counts' pointer and row stride last (CPU: stand-ins record it)."""
    built, launched = [], []
    monkeypatch.setattr(cuda_scorer, "module_for",
                        lambda index, defines=(): built.append(tuple(defines)) or type(
                            "M", (), {"threads": 544, "function": lambda self, *a: a})())
    monkeypatch.setattr(cuda_scorer, "_index", lambda device: 0)
    monkeypatch.setattr(cuda_topk, "launch_values",
                        lambda mod, fn, grid, threads, smem, values, device, *, pdl: launched.append(values))
    rows = 3
    args = (torch.zeros(rows, 64, 128, dtype=torch.uint8), torch.zeros(rows, 64),
            torch.zeros(4, cuda_scorer.SLOT_BYTES, dtype=torch.uint8),
            torch.zeros(rows, 2, dtype=torch.int32),
            torch.zeros(rows, dtype=torch.int32), None, torch.zeros(rows, 128))
    cfg = ScorerConfig(cuda_narrow_rows=0)
    counts = torch.zeros(rows + 1, cuda_topk.COUNTS_WORDS, dtype=torch.int32)
    cuda_scorer.launch_cuda_score(*args, page_size=64, sel_width=128, fill_width=0, splits=2, config=cfg,
                                  counts=counts)
    cuda_scorer.launch_cuda_score(*args, page_size=64, sel_width=128, fill_width=0, splits=2, config=cfg)
    assert built == [cuda_scorer.build_defines(4, counts=True), cuda_scorer.build_defines(4)]
    assert built[0] == (("SCORER_COUNTS", 1),)
    with_counts, without = launched
    assert len(with_counts) == len(without) + 2
    assert with_counts[-2].value == counts.data_ptr() and with_counts[-1].value == cuda_topk.COUNTS_WORDS
    with pytest.raises(ValueError, match="counts"):
        cuda_scorer.launch_cuda_score(*args, page_size=64, sel_width=128, fill_width=0, splits=2, config=cfg,
                                      counts=counts[:2])
