"""Kernels whose block shapes depend on their constexprs compile for a Hopper GPU, on any machine.

The CPU suite runs the Triton kernels under TRITON_INTERPRET=1, which executes them as Python
and does not type-check them as the compiler does: a variable whose block shape differs between
two branches runs there and fails to build on a GPU (the Dv-split GDN decode kernel once did).
Triton compiles for an sm_90 target without a GPU (its wheel carries ptxas), so this test builds
the launch variants that matter, in a subprocess with the interpreter off: the fused GDN decode
unsplit and split, the GEMV plain, with SwiGLU, with the RMSNorm in front (split and not) and
with the QK-norm + rotary epilogue, decode attention's split and merge kernels at head_dim 128
and 256 (and its grid with the KV heads fastest), the MoE pair GEMV's two kernels.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_kernels import decode_attention, gdn_decode, gemv, moe

    def build(fn, pointers, floats, consts):
        names = fn.arg_names
        sig = {}
        for name in names:
            if name in consts:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = pointers.get(name, "*bf16")
            else:
                sig[name] = "fp32" if name in floats else "i32"
        where = {(names.index(k),): v for k, v in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=where)
        triton.compile(src, target=GPUTarget("cuda", 90, 32))

    failed = []
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
    gemv_ptrs = {
        "part_ptr": "*fp32", "sq_out_ptr": "*fp32", "sq_in_ptr": "*fp32", "tickets_ptr": "*i32",
        "pos_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32",
    }
    variants = {  # name: (MODE, NORM, SPLIT, BLOCK_N, EARLY, ADD, NORM_PARTS)
        "plain": (gemv.PLAIN, False, 1, 16, 128, False, 0),
        "plain, 1,024 columns early": (gemv.PLAIN, False, 1, 16, 1024, False, 0),
        "plain + residual add and sums of squares, split": (
            gemv.PLAIN, False, 4, 16, 128, True, 0),
        "swiglu": (gemv.SWIGLU, False, 1, 16, 128, False, 0),
        "norm": (gemv.PLAIN, True, 1, 16, 128, False, 0),
        "scaled row + sums of squares, swiglu": (gemv.SWIGLU, False, 1, 16, 1024, False, 256),
        "scaled row + sums of squares, split": (gemv.PLAIN, False, 4, 8, 128, False, 256),
        "norm, split, 512 columns early": (gemv.SWIGLU, True, 2, 16, 512, False, 0),
        "norm + qk-norm + rope, split": (gemv.NORM_ROPE, True, 8, 128, 128, False, 0),
        "scaled row + sums of squares, qk-norm + rope": (
            gemv.NORM_ROPE, False, 4, 128, 512, False, 32),
    }
    for name, (mode, norm, split, block_n, early, add, parts) in variants.items():
        consts = dict(HAS_BIAS=False, MODE=mode, NORM=norm, HAS_RESIDUAL=norm, SPLIT=split,
                      TICKETS=split > 1, BLOCK_N=block_n, BLOCK_K=128, EARLY=early,
                      ROW_BLOCK=1024 if norm else 1, HALF=64, HEAD_DIM=128, PDL=False, ADD=add,
                      NORM_PARTS=parts)
        try:
            build(gemv._gemv_kernel, gemv_ptrs, {"eps", "qk_eps"}, consts)
        except Exception as exc:
            failed.append(f"gemv {name}: {exc}")
    reduce_consts = dict(HAS_BIAS=False, MODE=gemv.PLAIN, SPLIT=4, BLOCK=1024, HALF=1,
                         HEAD_DIM=2, PDL=False, ADD=True)
    try:
        build(gemv._gemv_reduce_kernel, gemv_ptrs, {"qk_eps"}, reduce_consts)
    except Exception as exc:
        failed.append(f"gemv reduce kernel + residual add: {exc}")
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
    print("\\n\\n".join(failed))
    sys.exit(1 if failed else 0)
    """
)


def test_shape_sensitive_kernels_compile_for_hopper(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "kernels"), str(ROOT / "runtime"), env.get("PYTHONPATH", "")]
    )
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # build, do not reuse a cached one
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
