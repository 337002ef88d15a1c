"""Model weights that sleep and wake in place: :class:`ModelWeights` (``docs/sleep.md``)."""

from kvcached.weights.model_weights import DEFAULT_WAKE_TIMEOUT_S, ModelWeights

__all__ = ["DEFAULT_WAKE_TIMEOUT_S", "ModelWeights"]
