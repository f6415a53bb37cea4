"""`pipeline serve-batch`: text files in, translations out, on any backend.

    translation.py  input lines -> windows, encoded and finished by the text service (runtime/texts.py)
    files.py        streaming, line-aligned, atomic file translation (over torchrun ranks)

`pipeline parity` translates through this same path, so it measures what is served; the
HTTP server (pipeline/serve/) and the Ray / Spark Translator answer through the same text service.
"""
