"""mlxtoy's float32 CPU kernels as MLX primitives (built from kernels/src by mlxtoy's install, setup.py)."""

# MLX's library first: an editable build's extension sits in kernels/, where its rpath to
# site-packages/mlx/lib does not reach, and finds libmlx already loaded
import mlx.core  # noqa: F401

from mlxtoy_kernels._ext import (cross_entropy_columns, decode_attention, gemv, gemv_many, rms_norm,  # noqa: F401
                                 rms_norm_grad, softmax_bias, softmax_grad, swiglu, swiglu_grad, threads, forms, openmp, adamw, sum_squares, rope,
                                 decode_block, logsumexp, argmax, pack, gemv_packed, attention, attention_grad,
                                 dequantize, dequantizes, affine_blocks, dequantize_affine, quant_linear, quant_vnni_ok, quant_x16_ok, quant_gemv_max_rows, quant_integer_form, block_attention_ok, gemm_ok, gemm_many, gemm,
                                 packed_row_pass, set_packed_row_pass)
