"""``@triton.jit`` building blocks shared by the families' kernels (tile order, offsets and masks, epilogue)."""
