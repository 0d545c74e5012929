"""What a Triton-interpreter worker process runs first (tests run Triton kernels on the CPU, TRITON_INTERPRET=1).

The interpreter keeps bf16 as uint16 bits and tl.dot multiplies the bits (triton-lang/triton#11584; its
documentation says bf16 operations are unsupported). A GPU multiplies bf16 values exactly into fp32, which fp32
operands reproduce, so the worker converts bf16 dot operands first; all else runs as the kernel says."""

INTERPRETER_PRELUDE = """
import sys, torch
import triton.language as tl
from triton.runtime import interpreter
dot = interpreter.InterpreterBuilder.create_dot
def dot_bf16_as_values(self, a, b, *rest):
    a, b = (self.cast_impl(t, tl.float32) if t.dtype == tl.bfloat16 else t for t in (a, b))
    return dot(self, a, b, *rest)
interpreter.InterpreterBuilder.create_dot = dot_bf16_as_values
"""
