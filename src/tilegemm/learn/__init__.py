"""The learning kit: puzzle kernels, the guide's kernels, interpreter debugging helpers."""
