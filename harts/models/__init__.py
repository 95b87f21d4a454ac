"""HARTS models: single-device modules, readable top to bottom (``harts.models.ling``: Ling-3.0)."""
