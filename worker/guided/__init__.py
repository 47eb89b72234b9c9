"""The guided path's grammar backends: the protocol (backend.py) and one module per
library (xgrammar_backend.py, llguidance_backend.py)."""
