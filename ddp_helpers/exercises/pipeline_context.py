"""Checkers for notebook 10's exercises (re-exported by `ddp_helpers.exercises`)."""
__all__ = []
