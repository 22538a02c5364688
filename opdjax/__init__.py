"""opdjax: on-policy distillation in JAX under training-inference mismatch."""

__version__ = "0.1.0"
