"""Advice: learning-rate scaling, gradient noise scale, BatchNorm caveats."""
