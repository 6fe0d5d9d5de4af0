"""Op families, one package each (matmul now; w4a16 and conv2d slot in beside it)."""
