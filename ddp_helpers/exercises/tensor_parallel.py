"""Checkers for notebook 09's exercises (re-exported by `ddp_helpers.exercises`)."""
__all__ = []
