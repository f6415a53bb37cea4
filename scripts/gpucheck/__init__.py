"""The parts of the one-command GPU check, by stage; scripts/gpu_check.py is its entry point and says
which part holds what (docs/gpu.md)."""
