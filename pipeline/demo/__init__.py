"""`pipeline demo`: the whole product on the built-in language pair, in minutes on a CPU.

    plan.py  what the demo runs on this machine: a pure function of pipeline/environment.py's facts
    run.py   runs it: train, average, export, serve-batch, parity, and the summary
"""
