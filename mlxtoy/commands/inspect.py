"""`mlxtoy inspect MODEL` and `mlxtoy inspect --env`."""

from __future__ import annotations

import argparse
import json

from mlxtoy import backend
from mlxtoy.errors import UserError
from mlxtoy.loading import build_model, describe, load_weights
from mlxtoy.models import fastmath


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("inspect", help="architecture, dims, tensor types, tokenizer, chat template, backend")
    p.add_argument("model", nargs="?",
                   help="a .gguf file, a Hugging Face folder or id (org/name[@rev], "
                        "org/name/file.gguf), or a built-in name")
    p.add_argument("--env", action="store_true", help="report device, BLAS and measured GEMM GFLOP/s")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def env_report() -> dict:
    info = backend.INFO
    return {
        "device": info.device,
        "blas": info.blas,
        "blas_path": info.blas_path,
        "blas_core": info.blas_core,
        "compute_dtype": str(info.compute_dtype).replace("mlx.core.", ""),
        "gemm_f32_gflops": round(backend.gemm_gflops(), 1),
        "cpu_kernels": fastmath.kernels_status(),
    } | ({"kernel_gemm_f32_gflops": round(backend.gemm_gflops(matmul=info.kernels.gemm), 1)} if fastmath.gemm_on() else {})


def run(args) -> int:
    if args.env or not args.model:
        if not args.env:
            raise UserError("inspect needs MODEL (or --env)")
        report = env_report()
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            width = max(map(len, report))
            for k, v in report.items():
                print(f"{k:{width}s} {v}")
        return 0
    cfg, weights, meta, tokenizer = load_weights(args.model)
    model = build_model(cfg, weights)
    report = describe(model, tokenizer, meta)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    c = report["config"]
    print(f"model         {report['source']} ({report['format']})")
    print(f"architecture  {report['architecture']}: {c['n_layers']} layers, d_model {c['d_model']}, "
          f"{c['n_heads']} heads x {c['d_head']} (kv heads {c['n_kv_heads']}), d_ff {c['d_ff']}, "
          f"vocab {c['vocab_size']}")
    print(f"rope          base {c['rope_base']}, {'adjacent pairs' if c['rope_traditional'] else 'neox'}"
          f", scaling {c['rope_scaling'] or 'none'}; context {c['context_length']}")
    print(f"parameters    {report['parameters'] / 1e6:.1f}M, "
          f"{'tied' if c['tie_embeddings'] else 'untied'} output, qkv bias {c['qkv_bias']}")
    types = ", ".join(f"{k} x{v}" for k, v in sorted(report["tensor_types"].items()))
    print(f"tensor types  {types or 'n/a'}")
    tok = report["tokenizer"]
    if tok:
        print("tokenizer     " + ", ".join(f"{k} {v}" for k, v in tok.items()))
    print(f"chat template {'yes' if report['chat_template'] else 'no'}")
    print(f"backend       {report['backend']}")
    return 0
