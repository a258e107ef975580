"""Checkers for notebook 00's exercises (re-exported by `ddp_helpers.exercises`)."""
__all__ = []
