"""Batch-1 kernel selection: which path each group of linear layers takes for a one-row input.

A decode step of one sequence multiplies a single row by every weight; cuBLAS picks poor kernels
for some of those narrow shapes, and the Triton GEMV (`ops.linear_small_m`), alone or with the
RMSNorm before it, the SwiGLU after it or the rotary + cache store after a qkv projection fused
in, wins on others. At start-up on a GPU each group of layers of the same shape is timed along
every path it has (`choose_small_m_kernels`); the layers keep the winner in their `gemv` /
`fuse_*` flags (layers/linear.py). Before that, the GEMV's own launch shape is timed per weight
shape (`tune_gemv_launch`: rows per program, columns a step, warps). `ATOM_SMALL_M_KERNELS`
overrides the timing, or adds a check of the choices on a whole batch-1 step ("checked",
`refine_small_m_kernels`).

FP8 layers (layers/fp8_linear.py) form groups of their own ("...+fp8"): their GEMV reads the FP8
bytes with the scales (launch shapes from `gemv.fp8_launch_candidates`, kept per shape with
`fp8=True`), and their "cublas" path is the many-row W8A8 product (`ops.fp8_linear`), so the
timing picks between the two per group as it does between cuBLAS and the GEMV for bf16.

The step check was the default until kernels were launched with programmatic dependent launch.
Since then it ranks paths against what W2 measures: on an H200 it swapped Qwen3-0.6B's fused
qkv (input norm, QK-norm, rotary and cache store in one GEMV: 5.2 us a layer alone against 7.7)
back to cuBLAS even at a 1% margin confirmed twice, and W2 measured 1.124 ms/token with the
check against 1.060 and 1.059 without it (one call, A/B/A); Llama-3.1-8B 4.252 with it against
4.236 without. So the per-group timing alone decides by default.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from atom_kernels import ops
from atom_runtime import envs
from atom_runtime.layers.forward_context import (
    AttentionMetadata,
    padding_state_metadata,
    set_attention_metadata,
    set_state_metadata,
)
from atom_runtime.layers.linear import LinearBase
from atom_runtime.worker.compile_cache import CompileCache

log = logging.getLogger(__name__)
# How much faster a whole batch-1 step must be, in two measurements in a row, for the step check
# ("checked") to override a path that won alone.
REFINE_MARGIN = 0.01
# "auto" (default): time the paths per layer group at start-up; "checked": that, then check the
# choices on a whole batch-1 step (`refine_small_m_kernels`); "cublas": always cuBLAS;
# "gemv": always the Triton GEMV, on the most fused path a layer has (`small_m_paths`' last).
SMALL_M_ENV = envs.SMALL_M_KERNELS.name


def select_small_m_kernels(
    model: nn.Module,
    device: torch.device,
    num_blocks: int,
    block_size: int,
    cache: CompileCache | None = None,
) -> dict[str, str]:
    """The one-row path of every layer group, set on the layers: timed per group (or taken from
    the compile cache), then (in "checked" mode) checked on a batch-1 step over the model's KV
    cache of `num_blocks` blocks. Returns {group: path}; empty off the GPU or with
    ATOM_SMALL_M_KERNELS=cublas."""
    choice = choose_small_m_kernels(model, device, cache)
    if choice and small_m_mode() == "checked":
        choice = refine_small_m_kernels(model, choice, num_blocks, block_size)
    return choice


def small_m_mode() -> str:
    """ATOM_SMALL_M_KERNELS: "auto" (the default), "checked", "cublas" or "gemv"."""
    return envs.SMALL_M_KERNELS.value()


def small_m_groups(model: nn.Module) -> dict[str, list[LinearBase]]:
    """The model's half-precision linear layers grouped by what a one-row product through them
    is: "[rmsnorm+]NxK[+act]" (the norm before it, the weight shape, the activation after)."""
    groups: dict[str, list[LinearBase]] = defaultdict(list)
    for module in model.modules():
        if isinstance(module, LinearBase) and module.weight.dtype != torch.float32:
            n, k = module.weight.shape
            norm = "rmsnorm+" if module.norm_before else ""
            act = f"+{module.act_after}" if module.act_after else ""
            groups[f"{norm}{n}x{k}{act}{_fp8_tag(module)}"].append(module)
    return groups


def _fp8_tag(layer: LinearBase) -> str:
    """ "+fp8" (per-tensor or per-channel scales) or "+fp8/block" for an FP8 layer."""
    if layer.weight_scale is None:
        return ""
    return "+fp8/block" if layer.weight_block_size is not None else "+fp8"


def _run_dtype(layer: LinearBase) -> torch.dtype:
    """The dtype of the layer's activations (its weight's, unless the weight is FP8)."""
    return layer.run_dtype if layer.weight_scale is not None else layer.weight.dtype


def small_m_paths(layer: LinearBase) -> list[str]:
    """The one-row paths a layer can take: "cublas", "gemv", and the GEMV with what the layer
    has around it fused in: "gemv+norm", "gemv+act", "gemv+norm+act", "gemv+rope" (with
    QK-norm when the model has it), "gemv+norm+rope"."""
    paths = ["cublas", "gemv"]
    if layer.norm_before:
        paths.append("gemv+norm")
    head_dim = getattr(layer, "head_dim", 0)
    if layer.rope_after and (not layer.qk_norm_after or head_dim & (head_dim - 1) == 0):
        # (QK-norm in the epilogue needs a power-of-two head_dim: a program owns one head.)
        paths.append("gemv+rope")
        if layer.norm_before:
            paths.append("gemv+norm+rope")
    if layer.act_after is not None:
        paths.append("gemv+act")
        if layer.norm_before:
            paths.append("gemv+norm+act")
    return paths


def use_small_m_path(layers: list[LinearBase], path: str) -> None:
    for m in layers:
        m.gemv = path != "cublas"
        m.fuse_norm = "+norm" in path
        m.fuse_act = "+act" in path
        m.fuse_rope = "+rope" in path


def choose_small_m_kernels(
    model: nn.Module, device: torch.device, cache: CompileCache | None = None
) -> dict[str, str]:
    """For each group of linear layers (`small_m_groups`), time a one-row product through every
    layer of the group (so weights stream from memory, as in a decode step) along each of its
    paths (`small_m_paths`: cuBLAS, the Triton GEMV, the GEMV with the norm before it, the
    activation after it or the rotary + cache store after it fused in), each replayed in a CUDA
    graph, the unfused ones paying for those kernels of their own; the layers take the
    fastest. A path whose kernels fail to build is left out. cuBLAS picks poor kernels for some
    narrow shapes at M = 1 (on an H200, Qwen3-0.6B's 1024 x 2048 o_proj: 10.7 us against
    3.1 us) and wins on others; a fused prologue can cost more than the launch it saves (every
    program recomputes it). Alone, a projection can time differently than inside a decode
    step: the model runner then checks the choices on the whole step
    (`refine_small_m_kernels`). A group (and a weight shape's GEMV launch) found in the compile
    cache for this GPU, these versions and this mode is not timed again. Returns
    {group: path}."""
    mode = small_m_mode()
    if device.type != "cuda" or mode == "cublas":
        return {}
    cache_mode = mode
    choice: dict[str, str] = {}
    tuned: set[tuple[int, int]] = set()
    recalled = 0
    for key, layers in small_m_groups(model).items():
        paths = small_m_paths(layers[0])
        shape = (*layers[0].weight.shape, _fp8_tag(layers[0]))
        if shape not in tuned:  # groups may share a shape
            tuned.add(shape)
            _launch_shape_for(layers, cache, cache_mode)
        if mode == "gemv":
            choice[key] = paths[-1]
        else:
            kept = cache.path(cache_mode, key) if cache is not None else None
            if kept in paths:
                choice[key] = kept
                recalled += 1
            else:
                choice[key] = _time_group(key, layers, paths)
                if cache is not None:
                    cache.put_path(cache_mode, key, choice[key])
        use_small_m_path(layers, choice[key])
    if cache is not None:
        if recalled < len(choice):
            cache.save()
        log.info(
            "one-row kernel paths: %d layer groups from the compile cache (%s), %d timed",
            recalled, cache.dir, len(choice) - recalled,
        )  # fmt: skip
    return choice


def _launch_shape_for(layers: list[LinearBase], cache: CompileCache | None, mode: str) -> None:
    """The GEMV launch shape of this weight shape: the compile cache's, else timed (and kept)."""
    from atom_kernels import gemv as gemv_kernels

    first = layers[0]
    n, k = first.weight.shape
    mode = f"{mode}{_fp8_tag(first)}"  # FP8 weights (and block scaling) launch shapes of their own
    kept = cache.launch_shape(mode, n, k) if cache is not None else None
    if kept is not None:
        fp8, block_scaled = first.weight_scale is not None, first.weight_block_size is not None
        gemv_kernels.set_launch_shape(n, k, kept, fp8=fp8, block_scaled=block_scaled)
        return
    best = tune_gemv_launch(layers)
    if cache is not None and best is not None:
        cache.put_launch_shape(mode, n, k, best)


def _time_group(key: str, layers: list[LinearBase], paths: list[str]) -> str:
    """The fastest one-row path of a layer group (`choose_small_m_kernels`), logged."""
    fns = _one_row_paths(layers[0])
    first = layers[0]
    fns["cublas"](first)  # cuBLAS must run: there is nothing to fall back on
    built = that_build(paths[1:], lambda p, fns=fns, m=first: fns[p](m), f"one-row {key}")
    usable = ["cublas", *built]
    runs = [lambda fn=fns[p]: [fn(m) for m in layers] for p in usable]  # noqa: B023
    timed = dict(zip(usable, graph_times(*runs), strict=True))
    best = min(timed, key=timed.get)
    log.info(
        "one-row %s projections (%d layers): %s -> %s",
        key,
        len(layers),
        ", ".join(f"{path} {t * 1e3 / len(layers):.1f} us" for path, t in timed.items()),
        best,
    )
    return best


def that_build(candidates: list, build, what: str) -> list:
    """The candidates whose kernels build and run on this GPU (`build(candidate)` once each,
    which also compiles them before any timing); a failure is logged and that one left out."""
    usable = []
    for candidate in candidates:
        try:
            build(candidate)
            torch.cuda.synchronize()
            usable.append(candidate)
        except Exception as exc:  # a kernel this GPU's Triton cannot build or run
            log.warning("%s: %s failed (%s); not used", what, candidate, exc)
    return usable


def tune_gemv_launch(layers: list[LinearBase]) -> dict[str, int] | None:
    """Time the Triton GEMV's launch shapes (`gemv.launch_candidates`) on a one-row product
    through every layer of a group (weights streaming from memory) and make the fastest the
    shape every later launch on that weight shape uses, fused paths included: the paths are
    then timed, and the graphs captured, with it."""
    from atom_kernels import gemv as gemv_kernels

    first = layers[0]
    n, k = first.weight.shape
    fp8 = first.weight_scale is not None
    block_scaled = first.weight_block_size is not None
    gemv_kernels.set_launch_shape(n, k, None, fp8=fp8, block_scaled=block_scaled)
    x = torch.randn(1, k, dtype=_run_dtype(first), device=first.weight.device)
    mp = torch.cuda.get_device_properties(first.weight.device).multi_processor_count
    if fp8:
        candidates = gemv_kernels.fp8_launch_candidates(n, k, mp, block_scaled=block_scaled)
    else:
        candidates = gemv_kernels.launch_candidates(n, k, mp)

    def launch(m: LinearBase, cfg: dict):
        return gemv_kernels.gemv(x, m.weight, **cfg, **m.gemv_scales())

    usable = that_build(candidates, lambda cfg: launch(first, cfg), f"one-row {n}x{k} GEMV launch")
    if not usable:
        return None
    times = graph_times(*(lambda cfg=cfg: [launch(m, cfg) for m in layers] for cfg in usable))
    best = usable[times.index(min(times))]
    gemv_kernels.set_launch_shape(n, k, best, fp8=fp8, block_scaled=block_scaled)
    log.info(
        "one-row %dx%d%s GEMV launch shapes: %s -> %s",
        n,
        k,
        _fp8_tag(first),
        ", ".join(
            f"n{c['block_n']}/k{c['block_k']}/split{c['split']}/w{c['num_warps']} "
            f"{t * 1e3 / len(layers):.1f} us"
            for c, t in zip(usable, times, strict=True)
        ),
        f"n{best['block_n']}/k{best['block_k']}/w{best['num_warps']}",
    )
    return best


def refine_small_m_kernels(
    model: nn.Module,
    choice: dict[str, str],
    num_blocks: int,
    block_size: int,
    context: int = 256,
) -> dict[str, str]:
    """Check the per-group one-row path choices on a whole batch-1 decode step: a projection
    timed alone can rank differently than inside the step (on an H200, Llama-3.1-8B's qkv
    and down GEMVs won alone by 0.7-0.8 us and lost 0.07 ms a step in place). Starting from
    the isolated choices, try each group's other paths in turn on the step (a CUDA graph of
    the forward and logits over a `context`-token cache, replayed) and keep a change that
    makes the step faster by more than noise (REFINE_MARGIN, twice in a row). Returns the kept
    choice, set on the layers."""
    dev = next(model.parameters()).device
    blocks = -(-context // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((1,), -1, dtype=torch.int64, device=dev),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None] % num_blocks,
        seq_lens=torch.tensor([context], dtype=torch.int32, device=dev),
        decode_only=True,
    )
    ids = torch.zeros(1, dtype=torch.int64, device=dev)
    pos = torch.tensor([context - 1], dtype=torch.int64, device=dev)

    def step_with(paths: dict[str, str]):
        def step():
            for key, path in paths.items():
                use_small_m_path(groups[key], path)
            return model.compute_logits(model(ids, pos))

        return step

    groups = small_m_groups(model)
    first = last = None  # step times, ms: the first timed, the last kept
    set_attention_metadata(meta)
    set_state_metadata(padding_state_metadata(1, 1, dev))  # hybrid models: touch no slot
    try:
        for key, layers in groups.items():
            for path in small_m_paths(layers[0]):
                if path == choice[key]:
                    continue
                # The current choice and the candidate, captured and replayed in turn,
                # so a clock ramp or a neighbour's burst does not favour either.
                candidate = {**choice, key: path}
                try:
                    now, new = graph_times(step_with(choice), step_with(candidate), replays=20)
                    first = now if first is None else first
                    last = now
                    if new < now * (1 - REFINE_MARGIN):  # confirmed by a second measurement
                        now, new = graph_times(step_with(choice), step_with(candidate), replays=20)
                except Exception as exc:  # the path's kernels failed to build: skip it
                    log.warning("one-row %s: the %s path failed (%s)", key, path, exc)
                    continue
                if new < now * (1 - REFINE_MARGIN):
                    choice, last = candidate, new
    finally:
        for key, path in choice.items():
            use_small_m_path(groups[key], path)
        set_attention_metadata(None)
        set_state_metadata(None)
    log.info(
        "one-row paths checked on a batch-1 step (%s ms as first chosen, %s ms as kept): %s",
        first,
        last,
        choice,
    )
    return choice


def _one_row_paths(layer: LinearBase) -> dict:
    """{path name: function of a layer of the group}: a one-row product with that layer's
    weight (and FP8 scales) along each of the layer's paths, with the add + RMSNorm before it,
    the activation after it, and the rotary + cache store after a qkv projection that the layer
    has, each in its own kernel or fused into the GEMV as the path says. "cublas" is the
    many-row product: cuBLAS, or `ops.fp8_linear` for an FP8 weight."""
    like, act, dtype = layer.weight, layer.act_after, _run_dtype(layer)
    k, dev = like.shape[1], like.device
    x = torch.randn(1, k, dtype=dtype, device=dev)
    residual = torch.randn_like(x)
    norm_w = torch.ones(k, dtype=dtype, device=dev)
    rope = _rope_target(layer) if layer.rope_after else None
    qk_norms = (None, None)
    if layer.qk_norm_after:  # stand-in QK-norm weights for a QK-norm model's qkv
        qk_norms = (torch.ones(layer.head_dim, dtype=dtype, device=dev),) * 2

    def path_fn(path: str):
        fuse_norm, fuse_act, fuse_rope = "+norm" in path, "+act" in path, "+rope" in path
        fused_act = act if fuse_act else None

        def run(m: LinearBase):
            w, f = m.weight, m.gemv_scales()
            if fuse_norm and fuse_rope:
                return ops.rms_norm_linear_rope_store_small_m(
                    x, residual, norm_w, 1e-6, w, None, *rope, *qk_norms, 1e-6, **f
                )[0]
            if fuse_norm:
                y = ops.rms_norm_linear_small_m(x, residual, norm_w, 1e-6, w, act=fused_act, **f)[0]
            else:
                h = ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)[0] if layer.norm_before else x
                if path == "cublas":
                    y = F.linear(h, w) if m.weight_scale is None else m._matmul(h)
                elif fuse_rope:
                    return ops.linear_rope_store_small_m(h, w, None, *rope, *qk_norms, 1e-6, **f)
                else:
                    y = ops.linear_small_m(h, w, act=fused_act, **f)
            if rope is not None:
                ops.qk_norm_rope_store_(y, rope[0], rope[1], *qk_norms, 1e-6, *rope[2:])
            return ops.silu_and_mul(y) if act is not None and not fuse_act else y

        return run

    return {path: path_fn(path) for path in small_m_paths(layer)}


def _rope_target(layer: LinearBase) -> tuple:
    """Stand-ins for what a qkv projection's rotary + cache store touches, for timing:
    (positions, cos/sin table, k cache, v cache, slot mapping, heads, kv heads, head_dim)."""
    dev, dtype = layer.weight.device, _run_dtype(layer)
    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
    cache = (4, 16, kv_heads, dim)
    return (
        torch.tensor([3], device=dev),
        torch.rand(8, dim, device=dev),
        torch.zeros(cache, dtype=dtype, device=dev),
        torch.zeros(cache, dtype=dtype, device=dev),
        torch.tensor([5], device=dev),
        heads,
        kv_heads,
        dim,
    )


def graph_times(*fns, replays: int = 5, rounds: int = 3) -> list[float]:
    """Milliseconds per call of each fn, each captured once in a CUDA graph; the graphs are
    replayed in turn for several rounds and each keeps its best round, so a clock or
    neighbour's hiccup during one measurement does not decide between near-equal paths."""
    graphs = []
    with torch.inference_mode():
        for fn in fns:
            fn()  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
            graphs.append(graph)
        torch.cuda.synchronize()
        best = [float("inf")] * len(fns)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(rounds):
            for i, graph in enumerate(graphs):
                start.record()
                for _ in range(replays):
                    graph.replay()
                end.record()
                end.synchronize()
                best[i] = min(best[i], start.elapsed_time(end) / replays)
    del graphs
    return best
