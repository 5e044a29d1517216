"""mlxtoy's float32 CPU kernels as MLX primitives (built from kernels/src by `pip install ./kernels`)."""

from mlxtoy_kernels._ext import (cross_entropy_columns, gemv, rms_norm, rms_norm_grad, softmax_bias,  # noqa: F401
                                 softmax_grad, swiglu, swiglu_grad, threads)
