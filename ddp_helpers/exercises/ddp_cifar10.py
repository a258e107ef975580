"""Checkers for notebook 06's exercises (re-exported by `ddp_helpers.exercises`)."""
__all__ = []
