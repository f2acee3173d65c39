"""diloco_jax: Decoupled DiLoCo in JAX (asynchronous, fault-tolerant, low-communication pre-training)."""

__version__ = "0.1.0"
