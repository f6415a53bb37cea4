"""`pipeline ray-translate`: the click command; the work is in pipeline/integrations/ray_job.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import click

from model.errors import UserError
from pipeline.cli_options import MODEL_DIR_KIND, GivenPath, decoding_options, options_from, pick
from pipeline.integrations.options import RayOptions
from pipeline.integrations.shards import RECORD, job_record, plan
from pipeline.serve_batch.files import target_suffix
from pipeline.serve_batch.translation import ServeBatchOptions
from runtime import languages, ort_constrained
from runtime.decoding import DecodingOptions
from runtime.glossary import Glossary, check_targets
from runtime.glossary_file import load_glossaries, no_gather
from runtime.model_dir import LoadOptions, ModelDir, check_load
from runtime.sentences import DEFAULT_LANG

log = logging.getLogger(__name__)

SEARCH = ("beam_size", "alpha", "max_len_a", "max_len_b", "min_len", "nbest", "rules")
# what changes a translation, recorded beside the outputs so that a rerun resumes only the same job
_RECORDED = ("backend", "precision", "shortlist", "long_lines", "invalid_utf8", "split", "lang", "src_lang", "tgt_lang",
             "format", "column")


@click.command("ray-translate")
@click.argument("model_dir", type=GivenPath(file_okay=False, kind=MODEL_DIR_KIND))
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True, type=GivenPath())
@click.option("--output-dir", metavar="DIR", required=True, type=GivenPath(file_okay=False),
              help="Write each input's translation to DIR/<input file name> (.gz dropped, the language suffix made "
                   "--suffix's; a Parquet file's gets --suffix, else .txt). Rerunning the same command skips the "
                   "inputs whose output is there.")
@click.option("--suffix", metavar="SUFFIX", default=None,
              help="The outputs' language suffix (.en: part-000.de -> part-000.en; added where the input has none) "
                   "[default: the target language, --tgt-lang or the one the model dir records; else the input's "
                   "name is kept].")
@options_from(LoadOptions, notes={"threads": "Per actor [default here: 1]; actors x threads = the cores used.",
                                  "device": "Per actor.",
                                  "parallel_batches": "Here: per actor, 1 unless given (each actor decodes one batch "
                                                      "at a time; more actors use more cores)."})
@decoding_options(notes={"nbest": "With N > 1 each output line holds the N best as 'text ||| score' "
                                    "joined by ' ||| ', best first (still one line per input line)."})
@options_from(ServeBatchOptions, skip=("window",))
@options_from(RayOptions)
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="Show translated lines and lines/s across the cluster on stderr (only on a terminal).")
def ray_translate(model_dir: str, inputs: tuple[str, ...], output_dir: str, suffix: str | None,
                  decoding: DecodingOptions, progress: bool, **fields: Any) -> None:
    """Translate INPUT files, globs or directories of shards (plain, .gz or Parquet) on a Ray cluster with the
    model in MODEL_DIR, one line-aligned output per input, exactly as serve-batch translates them.

    Ray Data reads the shards; actors (one per core by default) each load the model once and translate
    batches of rows; each output is written in line order and renamed into place when complete, so an
    interrupted job resumes where it stopped when rerun. A killed actor is restarted and its rows retried.
    Ends with a summary line on stderr (lines/s; Ray's start-up apart).
    """
    from pipeline.integrations.ray_job import translate_shards

    load_options: LoadOptions = pick(LoadOptions, fields)
    ray_opts: RayOptions = pick(RayOptions, fields)
    given = dataclasses.replace(pick(ServeBatchOptions, fields), decoding=decoding).validate()
    # a bad model dir, device, backend or language pair is one line here, before a cluster is reached (an actor's
    # would be Ray's error, on every actor)
    opened = ModelDir.open(model_dir)
    chosen = check_load(opened, load_options.validate())
    source, target = languages.own_languages(opened.manifest.model_config, opened.manifest.language_pair,
                                             given.src_lang, given.tgt_lang)  # a one-pair model's own: none
    # --lang as the actors will take it, from the source as the model spells it (DE recorded "DE": a rerun with
    # de was refused as other options)
    opts = dataclasses.replace(given, src_lang=source, tgt_lang=target).sentence_rules(opened.manifest.language_pair)
    if source is not None and source == target:  # as serve-batch says it (the glossary then finds nothing)
        log.info("%s", languages.same_language_notice(source))
    effective = decoding.for_model(opened.decoding_defaults, str(opened.path / "manifest.json"))
    glossary = _glossary(opened, chosen.name, load_options, opts.glossary) if opts.glossary else None
    asked = {k: v for k, v in {**dataclasses.asdict(load_options), **dataclasses.asdict(opts),
                               **dataclasses.asdict(ray_opts)}.items() if k in _RECORDED}
    # what runs, not how it was asked for: the backend "auto" picks; sentence rules only where sentences are split
    # (--split sentences, --format html)
    splits = opts.split == "sentences" or opts.format == "html"
    recorded = {**asked, "backend": chosen.name, "lang": opts.lang if splits else None}
    search = {name: getattr(effective, name) for name in SEARCH}
    settings = {**recorded,
                # the search the actors will run (the model's defaults where none is given), not how it was asked
                # for: `--beam-size 4` on a model whose default is 4 resumes its job; batch limits change nothing
                "decoding": search, **({"glossary": glossary_digest(glossary)} if glossary is not None else {})}
    # what the records of earlier versions held, so that a job they started resumes: version 2 the options as
    # asked; version 1 (before the outputs were listed) the search as asked too, and no glossary (with one, such
    # a record is compared as a new record is, and refused)
    # (--lang's default was en then: where sentences are split, such a record resumes only if the rules that run
    # now are its own, else its outputs and the rest would be split otherwise)
    as_asked = {**asked, "lang": opts.lang if splits else given.lang or DEFAULT_LANG}
    earlier = {2: {**as_asked, **{k: v for k, v in settings.items() if k not in asked}}}
    if glossary is None:
        earlier[1] = {**as_asked, "decoding": {name: getattr(decoding, name)
                                               for name in sorted(decoding.explicit or ())}}
    out = Path(os.path.abspath(output_dir))
    made = None if os.path.lexists(out) else out  # the first dir this run makes: removed if refused before any shard
    while made is not None and not os.path.lexists(made.parent):
        made = made.parent
    job = plan(list(inputs), output_dir, ray_opts.column, job_record(model_dir, settings),
               target_suffix(suffix, model_dir, opts.tgt_lang), model_dir,
               {version: job_record(model_dir, r) for version, r in earlier.items()})
    if not job.todo:
        click.echo(f"all {len(job.shards)} shard(s) already translated in {output_dir}", err=True)
        return
    try:
        stats = translate_shards(model_dir, job, load_options, decoding, dataclasses.replace(opts, glossary=()),
                                 ray_opts, progress, glossary)  # drawn only on a terminal (files.progress_bar)
    except BaseException:  # a cluster that cannot be reached or refuses the job: no empty dir left behind
        if made is not None and {p for p in made.rglob("*") if not p.is_dir()} <= {out / RECORD}:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if stats.truncated:
        log.warning("%d line(s) longer than the model's source limit were truncated (--long-lines error refuses "
                    "them)", stats.truncated)
    if stats.replaced:
        log.warning("%d line(s) had invalid UTF-8 or a NUL byte, replaced by U+FFFD", stats.replaced)
    if glossary is not None:
        (log.info if stats.terms_applied == stats.terms and stats.terms else log.warning)(
            "the glossary's terms: %d found in the input, %d of them in the translations", stats.terms,
            stats.terms_applied)
    click.echo(stats.summary(job), err=True)


def _glossary(opened: ModelDir, backend: str, load_options: LoadOptions, paths: tuple[str, ...]) -> Glossary:
    """The glossary files read here, once (a pipe has no second reader, and the actors are other processes: they
    get what was read), and checked against the model as serve-batch checks them, before a cluster is reached:
    every fixed target spelled by the vocabulary, and a backend that can apply it."""
    glossary = load_glossaries(paths)
    check_targets(glossary, opened.tokenizer.encode, opened.tokenizer.unk_id)
    if backend == "onnxruntime":
        why = ort_constrained.why_not(opened.path, opened.manifest, load_options.shortlist)
    elif backend == "torch":  # its eager step gathers; the default on a GPU (a CUDA graph) does not
        from runtime.registry import resolve_device
        from runtime.torch_backend import default_step_mode

        step = load_options.step or default_step_mode(resolve_device(load_options.device), load_options.shortlist)
        why = None if step == "eager" and not load_options.shortlist else no_gather(backend, load_options.shortlist) \
            + ("" if load_options.shortlist else " (--step eager)")
    else:
        why = no_gather(backend)
    if why:
        raise UserError(why)
    return glossary


def glossary_digest(glossary: Glossary) -> str:
    """What the glossary holds (not where it was read from), for the job's record: a rerun with other terms is
    refused rather than mixing two jobs' outputs."""
    entries = sorted([e.source, e.target, e.dnt] for e in glossary.entries)
    return hashlib.sha256(json.dumps(entries, ensure_ascii=False).encode()).hexdigest()
