"""Conformance sweeps for the torchneuron_lab device (see opinfo_sweep.py)."""
