"""`pipeline serve-batch`: text files in, translations out, on any backend.

    translation.py  input lines -> decoding windows -> output lines (the served format)
    serve.py        streaming, line-aligned, atomic file translation

`pipeline parity` translates through this same path, so it measures what is served; the
HTTP server (pipeline/serve/) formats its output with the same runtime.translate.format_line.
"""
