"""Compile every default tile of the quantized-matmul kernels for an H100 (sm_90) and print one JSON line each:
{"name", "ok", "registers", "stack", "shared", "error"}.  Run by tests/kernels/test_quant_compile.py in a process of
its own: the kernel tests' conftest turns Triton's interpreter on for its whole process, and an interpreted kernel
cannot be compiled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.awq_gemv import _awq_gemv_kernel, awq_gemv_config
from kernels.fp8_gemv import CONFIGS as FP8_GEMV_CONFIGS
from kernels.fp8_gemv import _fp8_gemv_dot_kernel, _fp8_gemv_kernel, _fp8_gemv_stream_kernel, fp8_gemv_config
from kernels.fp8_linear import _quant_rows_kernel, _w8a16_kernel, w8a16_config
from kernels.splitk import _reduce_kernel
from kernels.w4a16 import _w4a16_kernel, w4a16_config
from kernels.w4a16_tc import _tc_dequant_kernel, _w4a16_tc_kernel, tc_config

I32 = "i32"
INTS = ("M", "N", "K", "stride_xm", "stride_om", "stride_os", "k_per_split")


def _resources(cubin: bytes) -> tuple[int, int] | None:
    """(registers, stack bytes) of the cubin, or None without cuobjdump."""
    import triton.backends.nvidia as nv

    tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True, timeout=60)
    regs, stack = re.search(r"REG:(\d+)", out.stdout), re.search(r"STACK:(\d+)", out.stdout)
    return (int(regs.group(1)), int(stack.group(1))) if regs and stack else None


def compile_one(name: str, fn, types: dict[str, str], consts: dict, **options) -> dict:
    signature, constexprs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in consts:
            signature[arg] = "constexpr"
            constexprs[(i,)] = consts[arg]
        else:
            signature[arg] = types[arg]
    row: dict = {"name": name}
    # the new decode kernels are compiled as a launch at the 8B's shapes specializes them: pointers and the K, N
    # arguments divisible by 16 (what makes their loads 16 bytes wide)
    aligned = ("_ptr", "K", "N", "k_per_split", "packed_n") if "gemv" in name else ()
    if "w4a16_tc" in name:  # likewise the tensor-core AWQ GEMM, whose row strides are K and N
        aligned = ("_ptr", "K", "N", "stride_xm", "stride_om")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, arg in enumerate(fn.arg_names)
        if arg in types and arg.endswith(aligned) and aligned
    }
    try:
        kernel = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
    except Exception as e:  # noqa: BLE001 - reported, the test names it
        return {**row, "ok": False, "error": f"{type(e).__name__}: {e}"[-1500:]}
    used = _resources(kernel.asm["cubin"])
    return {
        **row,
        "ok": True,
        "registers": used and used[0],
        "stack": used and used[1],
        "shared": kernel.metadata.shared,
    }


def cases():
    for k in (4096, 14336, 32768):
        block = triton.next_power_of_2(min(k, 16384))
        yield (
            f"quantize rows K={k}",
            _quant_rows_kernel,
            dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32", K=I32, stride_xm=I32),
            dict(BLOCK=block, ONE_PASS=block >= k, NATIVE=True),
            dict(num_warps=min(16, max(4, block // 1024))),
        )
    for dtype in ("bf16", "fp16"):
        for m, use_dot in ((1, False), (2, False), (8, True), (16, True), (32, True)):
            for out in (dtype, "fp32"):  # the output itself, or split-K partials
                cfg = w8a16_config(m, use_dot)
                consts = dict(
                    BLOCK_M=cfg.pop("BLOCK_M"),
                    BLOCK_N=cfg.pop("BLOCK_N"),
                    BLOCK_K=cfg.pop("BLOCK_K"),
                    USE_DOT=use_dot,
                    DOT_DTYPE=tl.bfloat16 if dtype == "bf16" else tl.float16,
                    EVEN_K=True,
                )
                types = dict(x_ptr=f"*{dtype}", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr=f"*{out}")
                types.update(dict.fromkeys(INTS, I32))
                yield f"w8a16 {dtype} m={m} dot={use_dot} -> {out}", _w8a16_kernel, types, consts, cfg
    for group in (32, 128):
        for m, use_dot in ((1, False), (8, True), (32, True), (64, True), (256, True)):
            cfg = w4a16_config(m, group, use_dot)
            consts = dict(
                GROUP=group,
                BLOCK_M=cfg.pop("BLOCK_M"),
                BLOCK_N=cfg.pop("BLOCK_N"),
                BLOCK_K=cfg.pop("BLOCK_K"),
                SWAP_AB=cfg.pop("SWAP_AB"),
                USE_DOT=use_dot,
                FP16=True,
                DOT_PRECISION="tf32",
            )
            types = dict(x_ptr="*fp16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", out_ptr="*fp16")
            types.update(dict.fromkeys(INTS, I32))
            yield f"w4a16 m={m} group={group} dot={use_dot}", _w4a16_kernel, types, consts, cfg
    for m in (8, 32, 64, 128):  # kernels/w4a16_tc.py's default tiles (the paired float16 dequantization)
        for splits in (1, 2):  # the output itself, or split-K partials (summed in the kernel where the tile says)
            cfg = tc_config(m, 4096, 4096)
            cfg.pop("WAVES", None)
            in_kernel = cfg.pop("IN_KERNEL", False)
            even = cfg.pop("EVEN", False)  # unmasked where the tile divides M and N, as w4a16_tc launches it
            block_m = cfg.pop("BLOCK_M")
            consts = dict(
                GROUP=128,
                BLOCK_M=block_m,
                BLOCK_N=cfg.pop("BLOCK_N"),
                SWAP_AB=cfg.pop("SWAP_AB"),
                FAST=True,
                WORD_PAIRS=cfg.pop("WORD_PAIRS", False),
                EVEN_M=even and m % block_m == 0,
                EVEN_N=even,  # N = 4,096: a multiple of every column tile
                ONE_DOT=cfg.pop("ONE_DOT", True),
                F16=True,
                DOT_PRECISION="tf32",
                SPLITS=splits,
                IN_KERNEL=in_kernel and splits > 1,
            )
            types = dict(x_ptr="*fp16", packed_ptr="*i32", zf_ptr="*fp16", scales_ptr="*fp16", out_ptr="*fp16")
            types.update(part_ptr="*fp32", ticket_ptr="*i32")
            types.update(dict.fromkeys(("M", "N", "K", "stride_xm", "stride_om", "blocks_per_split"), I32))
            yield f"w4a16_tc m={m} splits={splits}", _w4a16_tc_kernel, types, consts, cfg
    for dtype in ("fp16", "bf16"):  # the repacked weight dequantized for cuBLAS (kernels/w4a16_tc.py: tc_dequantize)
        types = dict(packed_ptr="*i32", zf_ptr="*fp16", scales_ptr=f"*{dtype}", out_ptr=f"*{dtype}", N=I32)
        consts = dict(GROUP=128, BLOCK_N=256, F16=dtype == "fp16")
        yield f"tc_dequantize -> {dtype}", _tc_dequant_kernel, types, consts, dict(num_warps=4)
    cpu = torch.device("cpu")  # the rule's tiles; SPLITS is set to 2 so that the in-kernel sum is compiled
    for rows_up_to, _ in FP8_GEMV_CONFIGS:
        cfg = fp8_gemv_config(rows_up_to, 4096, 4096, cpu)
        kind = cfg.pop("KIND")
        if kind == "stream":  # one row, no K splits; the weight by pointer loads (TMA off by default)
            consts = {key: cfg.pop(key) for key in ("BLOCK_N", "BLOCK_K", "STAGES")}
            consts.update(TMA=cfg.pop("TMA", False), PER_TENSOR=False, w_desc=None, PDL=True)  # PDL: on Hopper
            for key in ("BLOCK_M", "CTAS"):
                cfg.pop(key, None)
            types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", N=I32, K=I32, tiles=I32)
            yield f"fp8_gemv bf16 m<={rows_up_to} stream", _fp8_gemv_stream_kernel, types, consts, cfg
            continue
        consts = {key: cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        cfg.pop("SPLITS")
        consts.update(SPLITS=2, IN_KERNEL=True, PER_TENSOR=False, EVEN_K=True)
        if kind == "dot":
            consts["DOT_DTYPE"] = tl.bfloat16
        types = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32")
        types.update(ticket_ptr="*i32", **dict.fromkeys(("M", "N", "K", "stride_xm", "stride_om", "k_per_split"), I32))
        fn = _fp8_gemv_dot_kernel if kind == "dot" else _fp8_gemv_kernel
        yield f"fp8_gemv bf16 m<={rows_up_to} {kind} split in-kernel", fn, types, consts, cfg
    cfg = awq_gemv_config(1, 4096, 4096, 128, cpu)
    cfg.pop("SPLITS")
    consts = dict(GROUP=128, BLOCK_N=cfg.pop("BLOCK_N"), BLOCK_K=cfg.pop("BLOCK_K"), SPLITS=2, IN_KERNEL=True)
    types = dict(x_ptr="*fp16", qweight_ptr="*i32", qzeros_ptr="*i32", scales_ptr="*fp16", out_ptr="*fp16")
    types.update(part_ptr="*fp32", ticket_ptr="*i32")
    types.update(dict.fromkeys(("M", "N", "K", "stride_xm", "stride_om", "k_per_split", "packed_n"), I32))
    yield "awq_gemv fp16 m=1 split in-kernel", _awq_gemv_kernel, types, consts, cfg
    yield (
        "split-K sum",
        _reduce_kernel,
        dict(part_ptr="*fp32", out_ptr="*bf16", total=I32),
        dict(SPLITS=7, BLOCK=1024),
        dict(num_warps=4),
    )


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET: interpreted kernels cannot be compiled")
    for name, fn, types, consts, options in cases():
        print(json.dumps(compile_one(name, fn, types, consts, **options)), flush=True)
