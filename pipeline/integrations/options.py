"""RayOptions: where and how wide `pipeline ray-translate` runs (importable without Ray, for the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.cli_options import opt


@dataclass(frozen=True)
class RayOptions:
    """Where and how wide a ray-translate job runs; the command's options are generated from these fields."""

    address: str | None = opt(None, "The Ray cluster to run on: `auto` (the one `ray start` runs here) or "
                                    "HOST:PORT of its head [default: a local cluster on this machine's cores, started "
                                    "and stopped by the command].", metavar="ADDRESS")
    actors: int | None = opt(None, "Translator actors, each loading the model once [default: the cluster's CPUs / "
                                   "--threads, or its GPUs / --gpus-per-actor].", min=1)
    batch_size: int = opt(500, "Rows per batch an actor translates (sorted by length within it): smaller "
                               "batches balance the actors better, larger ones pad less.", min=1)
    column: str = opt("text", "The column of source text in Parquet inputs.", metavar="NAME")
    gpus_per_actor: float = opt(0.0, "GPUs each actor reserves (1 with --backend torch --device cuda: the CUDA-graph "
                                     "step); 0: CPU actors.", min=0.0)
