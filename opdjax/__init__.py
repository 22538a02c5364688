"""opdjax: on-policy distillation in JAX under training-inference mismatch.

The pure functions, for use in any trainer: `opdjax.mismatch` (metrics), `opdjax.corrections` (IS weights,
rejection), `opdjax.losses` (OPD losses and the teacher data each needs), `opdjax.quant` (simulated quantization).
They live in `opdjax.core` and `opdjax.quant`; the rest of the package follows the data flow (see README).
"""

from opdjax import quant
from opdjax.core import corrections, losses, mismatch

__version__ = "0.1.0"

__all__ = ["corrections", "losses", "mismatch", "quant"]
