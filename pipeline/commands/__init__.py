"""The click commands, one module each: they parse options, check them and delegate to the
stage that does the work (pipeline.training, export, pipeline.serve_batch, pipeline.serve,
pipeline.evaluation, pipeline.demo, pipeline.environment). pipeline/cli.py registers them all.

    train.py        `pipeline train` and `pipeline average`
    export.py       `pipeline export`
    serve_batch.py  `pipeline serve-batch` (files)
    serve.py        `pipeline serve` (HTTP)
    parity.py       `pipeline parity`
    bench.py        `pipeline bench`
    tune.py         `pipeline tune-decoding`
    demo.py         `pipeline demo`
    doctor.py       `pipeline doctor`
    random_checkpoint.py  `pipeline random-checkpoint` (a random-weight model to bench a shape)
"""
