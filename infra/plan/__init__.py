"""Heterogeneous placement: which GPU classes serve and which train (`tide plan`)."""
