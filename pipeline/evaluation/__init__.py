"""Measuring a model dir: do the backends agree, how fast are they, which decoding is best.

    parity.py               `pipeline parity`: each backend against the PyTorch reference, gated
    bench.py                `pipeline bench`: throughput, latency and memory per backend
    bench_compare.py        one table over several model dirs, optionally against CTranslate2
    ctranslate2_compare.py  the same weights converted to and run in CTranslate2
    tuning.py               `pipeline tune-decoding`: beam width and length penalty by BLEU on val
"""
