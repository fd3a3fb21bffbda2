"""Checks that need an NVIDIA GPU; run by infra/gpu-check, never collected by pytest."""
