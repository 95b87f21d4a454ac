"""Engines and adapters that run HARTS inside other RL frameworks; each module imports its framework itself."""
