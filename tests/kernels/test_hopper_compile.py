"""Kernels whose block shapes depend on their constexprs compile for a Hopper GPU, on any machine.

The CPU suite runs the Triton kernels under TRITON_INTERPRET=1, which executes them as Python
and does not type-check them as the compiler does: a variable whose block shape differs between
two branches runs there and fails to build on a GPU (the Dv-split GDN decode kernel once did).
Triton compiles for an sm_90 target without a GPU (its wheel carries ptxas), so this test builds
the launch variants that matter, in a subprocess with the interpreter off: the fused GDN decode
unsplit and split, the wide GDN decode with an fp32 and a bf16 state, prefetching or not, the GEMV plain, with SwiGLU, with the RMSNorm in front (split and not) and
with the QK-norm + rotary epilogue, decode attention's split and merge kernels at head_dim 128
and 256 (and its grid with the KV heads fastest), the MoE pair GEMV's two kernels; and the FP8
paths: the GEMV on e4m3fn weights (per-row and block scales, SwiGLU, rotary into an FP8 cache),
decode and prefill attention over an FP8 cache, the cache stores, the activation quantizers and
the W8A8 block GEMM (an FP8 tensor-core dot).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

HEAD = """
    import inspect
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_kernels import (
        decode_attention, fp8_gemm, fp8_quant, fused, gdn_decode, gdn_decode_wide, gemv,
        kv_cache, moe, prefill_attention,
    )

    # argv: the target ("cuda:90", "hip:gfx942") and the FP8 element type it computes in.
    backend, arch = sys.argv[1].split(":")
    TARGET = GPUTarget("cuda", int(arch), 32) if backend == "cuda" else GPUTarget("hip", arch, 64)
    fp8 = sys.argv[2]

    def build(fn, pointers, floats, consts):
        # Constexprs left out take their defaults (the FP8 switches default to off).
        defaults = {p.name: p.default for p in fn.params
                    if p.is_constexpr and p.default is not inspect.Parameter.empty}
        consts = defaults | consts
        names = fn.arg_names
        sig = {}
        for name in names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in pointers:
                sig[name] = pointers[name]
            elif name.endswith("_ptr"):
                sig[name] = pointers.get(name, "*bf16")
            else:
                sig[name] = "fp32" if name in floats else "i32"
        where = {(names.index(k),): v for k, v in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=where)
        triton.compile(src, target=TARGET)

    failed = []
"""

BF16_VARIANTS = """
    gdn_ptrs = {
        "ssm_state_ptr": "*fp32", "a_log_ptr": "*fp32", "dt_bias_ptr": "*fp32",
        "slot_ids_ptr": "*i32", "has_initial_state_ptr": "*u8", "tickets_ptr": "*i32",
    }
    for v_split in (1, 8):
        consts = dict(HK=16, HV=32, GROUP=2, DK=128, DV=128, WIDTH=4, BLOCK_G=2, BLOCK_K=128,
                      BLOCK_V=128 // v_split, V_SPLIT=v_split, BLOCK_W=4, PDL=False)
        try:
            build(gdn_decode._gdn_decode_kernel, gdn_ptrs, {"scale", "eps"}, consts)
        except Exception as exc:
            failed.append(f"gdn_decode V_SPLIT={v_split}: {exc}")
    for state, block_v, prefetch in (("*fp32", 32, True), ("*bf16", 64, True),
                                     ("*fp32", 16, False)):
        consts = dict(HK=16, HV=32, GROUP=2, DK=128, DV=128, WIDTH=4, BLOCK_G=2, BLOCK_K=128,
                      BLOCK_DV=128, BLOCK_V=block_v, TILES=128 // block_v, BLOCK_W=4,
                      PREFETCH=prefetch, PDL=False)
        try:
            build(gdn_decode_wide._gdn_decode_wide_kernel, {**gdn_ptrs, "ssm_state_ptr": state},
                  {"scale", "eps"}, consts)
        except Exception as exc:
            failed.append(f"gdn_decode_wide {state} BLOCK_V={block_v} PREFETCH={prefetch}: {exc}")
    gemv_ptrs = {
        "part_ptr": "*fp32", "tickets_ptr": "*i32", "pos_ptr": "*i64", "slot_ptr": "*i64",
        "cos_sin_ptr": "*fp32",
    }
    variants = {  # name: (MODE, NORM, SPLIT, BLOCK_N, EARLY)
        "plain": (gemv.PLAIN, False, 1, 16, 128),
        "plain, 1,024 columns early": (gemv.PLAIN, False, 1, 16, 1024),
        "plain, split": (gemv.PLAIN, False, 4, 16, 128),
        "swiglu": (gemv.SWIGLU, False, 1, 16, 128),
        "norm": (gemv.PLAIN, True, 1, 16, 128),
        "norm, split, 512 columns early": (gemv.SWIGLU, True, 2, 16, 512),
        "norm + qk-norm + rope, split": (gemv.NORM_ROPE, True, 8, 128, 128),
    }
    for name, (mode, norm, split, block_n, early) in variants.items():
        consts = dict(HAS_BIAS=False, MODE=mode, NORM=norm, HAS_RESIDUAL=norm, SPLIT=split,
                      TICKETS=split > 1, BLOCK_N=block_n, BLOCK_K=128, EARLY=early,
                      ROW_BLOCK=1024 if norm else 1, HALF=64, HEAD_DIM=128, PDL=False)
        try:
            build(gemv._gemv_kernel, gemv_ptrs, {"eps", "qk_eps"}, consts)
        except Exception as exc:
            failed.append(f"gemv {name}: {exc}")
    reduce_consts = dict(HAS_BIAS=False, MODE=gemv.PLAIN, SPLIT=4, BLOCK=1024, HALF=1,
                         HEAD_DIM=2, PDL=False)
    try:
        build(gemv._gemv_reduce_kernel, gemv_ptrs, {"qk_eps"}, reduce_consts)
    except Exception as exc:
        failed.append(f"gemv reduce kernel: {exc}")
    attn_ptrs = {
        "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_acc_ptr": "*fp32",
        "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
    }
    for head_dim, splits, heads_fastest, heads in ((128, 32, False, 1), (256, 1, False, 1),
                                                   (128, 1, True, 1), (128, 1, False, 2)):
        block_n = decode_attention.decode_config(head_dim)["block_n"]
        consts = dict(GROUP=2, HEAD_DIM=head_dim, PAGE_SIZE=16, NUM_SPLITS=splits, BLOCK_G=16,
                      BLOCK_N=block_n, BLOCK_D=head_dim, IEEE_DOT=False,
                      HEADS_FASTEST=heads_fastest, PDL=False, HEADS=heads)
        merge = dict(HEAD_DIM=head_dim, NUM_SPLITS=splits, BLOCK_S=min(8, splits),
                     BLOCK_D=head_dim, BLOCK_N=block_n, PDL=False)
        for fn, c in ((decode_attention._decode_split_kernel, consts),
                      (decode_attention._decode_merge_kernel, merge)):
            try:
                build(fn, attn_ptrs, {"scale_log2"}, c)
            except Exception as exc:
                failed.append(f"{fn.__name__} head_dim={head_dim}: {exc}")
    moe_ptrs = {"ids_ptr": "*i32", "weights_ptr": "*fp32"}
    for fn, consts in ((moe._moe_gemv_gate_up_kernel, dict(TOP_K=9, BLOCK_N=4, BLOCK_K=2048)),
                       (moe._moe_gemv_down_kernel, dict(TOP_K=9, BLOCK_P=16, BLOCK_N=16, BLOCK_K=512)),
                       (moe._moe_topk_kernel, dict(TOP_K=8, RENORMALIZE=True, SHARED=True,
                                                   BLOCK_E=256))):
        try:
            build(fn, moe_ptrs, set(), consts)
        except Exception as exc:
            failed.append(f"{fn.__name__}: {exc}")
"""

FP8_VARIANTS = """
    gemv_ptrs = {
        "part_ptr": "*fp32", "tickets_ptr": "*i32", "pos_ptr": "*i64", "slot_ptr": "*i64",
        "cos_sin_ptr": "*fp32",
    }
    attn_ptrs = {
        "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_acc_ptr": "*fp32",
        "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
    }
    fp8_gemv_ptrs = dict(gemv_ptrs, w_ptr=fp8, w_scale_ptr="*fp32", k_cache_ptr=fp8,
                         v_cache_ptr=fp8, k_scale="*fp32", v_scale="fp32")
    fp8_variants = {  # name: (MODE, W_SCALE, SAME_BLOCK, SPLIT, BLOCK_N, EARLY, KV_FP8)
        "fp8 per-row, split": (gemv.PLAIN, 1, True, 4, 32, 1024, False),
        "fp8 block": (gemv.PLAIN, 2, True, 1, 32, 1024, False),
        "fp8 block, swiglu": (gemv.SWIGLU, 2, False, 2, 32, 512, False),
        "fp8 block, rope into an fp8 cache": (gemv.ROPE, 2, True, 1, 32, 128, True),
        "fp8 block, qk-norm + rope, head_dim 256": (gemv.NORM_ROPE, 2, False, 4, 256, 128, True),
    }
    for name, (mode, w_scale, same, split, block_n, early, kv_fp8) in fp8_variants.items():
        head_dim = 256 if block_n == 256 else 128
        consts = dict(HAS_BIAS=False, MODE=mode, NORM=False, HAS_RESIDUAL=False, SPLIT=split,
                      TICKETS=split > 1, BLOCK_N=block_n, BLOCK_K=128 if head_dim == 128 else 64,
                      EARLY=early, ROW_BLOCK=1, HALF=head_dim // 2, HEAD_DIM=head_dim, PDL=False,
                      W_SCALE=w_scale, SCALE_BN=128, SCALE_BK=128,
                      SAME_BLOCK=same, KV_FP8=kv_fp8, K_SCALE_PTR=True, V_SCALE_PTR=False)
        try:
            build(gemv._gemv_kernel, fp8_gemv_ptrs, {"eps", "qk_eps"}, consts)
        except Exception as exc:
            failed.append(f"gemv {name}: {exc}")
    fp8_attn = dict(attn_ptrs, k_cache_ptr=fp8, v_cache_ptr=fp8, k_scale="*fp32",
                    v_scale="*fp32")
    for splits, heads in ((1, 2), (8, 1)):
        consts = dict(GROUP=2, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=splits, BLOCK_G=16,
                      BLOCK_N=64, BLOCK_D=128, IEEE_DOT=False, HEADS_FASTEST=False, PDL=False,
                      HEADS=heads, FP8=True, K_SCALE_PTR=True, V_SCALE_PTR=True)
        try:
            build(decode_attention._decode_split_kernel, fp8_attn, {"scale_log2"}, consts)
        except Exception as exc:
            failed.append(f"decode over an fp8 cache, {splits} splits: {exc}")
    prefill_ptrs = dict(fp8_attn, cu_seqlens_ptr="*i32", seq_lens_ptr="*i32")
    for lookup, split in ((0, True), (2, False)):
        consts = dict(HEADS_PER_PROG=2, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=128, BLOCK_N=64,
                      BLOCK_D=128, SPLIT=split, KV_LOOKUP=lookup, LOOP_STAGES=0, WARP_SPEC=False,
                      IEEE_DOT=False, FP8=True, K_SCALE_PTR=True, V_SCALE_PTR=True)
        try:
            build(prefill_attention._prefill_kernel, prefill_ptrs, {"scale_log2"}, consts)
        except Exception as exc:
            failed.append(f"prefill over an fp8 cache, lookup {lookup}: {exc}")
    store_ptrs = dict(k_cache_ptr=fp8, v_cache_ptr=fp8, slot_ptr="*i64", k_scale="*fp32",
                      v_scale="fp32", positions_ptr="*i64", cos_sin_ptr="*fp32")
    for fn, consts in (
        (kv_cache._store_kvcache_kernel, dict(HEAD_DIM=128, BLOCK_D=128, PDL=False, FP8=True,
                                              K_SCALE_PTR=True, V_SCALE_PTR=False)),
        (fused._qk_prep_kernel, dict(HAS_NORM=True, HEAD_DIM=128, Q_HEAD_STRIDE=128, ROT_HALF=64,
                                     BLOCK_HQ=16, BLOCK_HK=8, BLOCK_ROT=64, BLOCK_REST=1,
                                     BLOCK_D=128, PDL=False, FP8=True, K_SCALE_PTR=True,
                                     V_SCALE_PTR=False)),
    ):
        try:
            build(fn, store_ptrs, {"eps"}, consts)
        except Exception as exc:
            failed.append(f"{fn.__name__} into an fp8 cache: {exc}")
    quant_ptrs = dict(q_ptr=fp8, s_ptr="*fp32", scale="*fp32", a_ptr=fp8, b_ptr=fp8,
                      a_s_ptr="*fp32", b_s_ptr="*fp32")
    for fn, floats, consts in (
        (fp8_quant._dynamic_quant_kernel, {"qmax"}, dict(BLOCK=128)),
        (fp8_quant._static_quant_kernel, set(), dict(IS_PTR=True, BLOCK=1024)),
        (fp8_gemm._w8a8_matmul_kernel, set(),
         dict(GROUP_N=128, GROUP_K=128, K_GROUPED=True, HAS_BIAS=True, BLOCK_M=64, BLOCK_N=128,
              BLOCK_K=128, SWIZZLE_M=8)),
        (fp8_gemm._w8a8_matmul_kernel, set(),
         dict(GROUP_N=1, GROUP_K=128, K_GROUPED=False, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=64,
              BLOCK_K=128, SWIZZLE_M=8)),
    ):
        try:
            build(fn, quant_ptrs, floats, consts)
        except Exception as exc:
            failed.append(f"{fn.__name__} {consts}: {exc}")
"""

TAIL = """
    print("\\n\\n".join(failed))
    sys.exit(1 if failed else 0)
"""


BUILDS = {  # test name: (script, target, FP8 element type, the Triton backend it needs)
    "hopper": (HEAD + BF16_VARIANTS + TAIL, "cuda:90", "*fp8e4nv", "nvidia"),
    "hopper fp8": (HEAD + FP8_VARIANTS + TAIL, "cuda:90", "*fp8e4nv", "nvidia"),
    "mi300 fp8": (HEAD + FP8_VARIANTS + TAIL, "hip:gfx942", "*fp8e4b8", "amd"),
}


def _has_backend(name: str) -> bool:
    try:
        __import__(f"triton.backends.{name}")
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The three builds, started together (each is a single-threaded compiler run, and the suite
    runs one test at a time: side by side they take the machine's other cores) and awaited by the
    test that reads one. Each compiles into its own empty cache: build, do not reuse."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "runtime"), env.get("PYTHONPATH", "")]
    )
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {}
    try:
        for name, (script, target, fp8, backend) in BUILDS.items():
            if not _has_backend(backend):
                continue
            cache = tmp_path_factory.mktemp("triton-cache")
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(script), target, fp8],
                env={**env, "TRITON_CACHE_DIR": str(cache)},
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.communicate()


def _compiled(builds, name: str) -> None:
    backend = BUILDS[name][3]
    if name not in builds:
        pytest.skip(f"Triton has no {backend} backend here (triton.backends.{backend})")
    proc = builds[name]
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-6000:] + stderr[-6000:]


def test_shape_sensitive_kernels_compile_for_hopper(builds):
    _compiled(builds, "hopper")


def test_fp8_kernels_compile_for_hopper(builds):
    """The FP8 paths in H100/H200's format (e4m3fn), FP8 tensor-core dot included."""
    _compiled(builds, "hopper fp8")


def test_fp8_kernels_compile_for_mi300(builds):
    """The FP8 paths in MI300's format (e4m3fnuz, gfx942), which no CPU test can run."""
    _compiled(builds, "mi300 fp8")
