"""Resolving a run before anything trains: the run folder (claimed for this process), its spec, the
checkpoint --resume continues from, the --init-from source, the data and the model's config. Nothing
is written before all of it checks out (a run cut short at its end is only marked finished)."""

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from ..formats.checkpoint import load_checkpoint
from ..data.corpus import builtin_dataset
from ..data.hf_tokenizer import load_tokenizer
from ..data.text import is_text, read_cache, text_tokens
from ..data.tokens import load_tokens, split
from ..errors import AnectypesError, CheckpointError
from ..model.config import ModelConfig, load_config, with_defaults
from ..model.lora import check_rank, of_spec
from ..sources import fits, resolve, same_vocabulary
from ..runs import BEST, LATEST, RunDir, RunError, RunSpec, finite, model_name, new_run_id
from . import report_to


class Run(NamedTuple):
    """What rank 0 reads from files to start a run (every rank gets it)."""
    rd: RunDir                 # the run folder, claimed
    spec: RunSpec
    doc: dict                  # config.json's document (a new run: its id)
    ckpt: object               # the checkpoint --resume continues from, or None
    extended: str              # what --resume extended ("steps 24 -> 30"), or None
    ref: object                # the --init-from source (a new run from one), or None
    resumed_from: str          # the checkpoint's file name, or None


def resolve_run(args, given, ranks=None):
    """The Run: the claimed run folder, open_run's answer and the --init-from source (None on a resume):
    what rank 0 reads from files. Under mpirun, `ranks` is its process count: the run's rank count (given or
    stored) must be it."""
    if ranks and given.setdefault("ranks", ranks) != ranks:
        raise RunError(f"--ranks {given['ranks']} but mpirun started {ranks} processes")
    if not (args.scratch or args.resume or args.init_from):
        raise AnectypesError("say how to start: --scratch, --resume or --init-from SOURCE")
    rd = claim_run_dir(args, given)
    try:
        spec, doc, ckpt, extended, name = open_run(rd, args, given)
        report_to.check(spec)
        ref = resolve(spec.init_from) if spec.init_from and not ckpt else None
    except BaseException:
        rd.release()
        raise
    return Run(rd, spec, doc, ckpt, extended, ref, name)


def claim_run_dir(args, given):
    """The run folder (RunDir.claim: taken for this process before anything in it is read): --run-dir, the
    newest run with a checkpoint for --resume, or a new runs/<time>-<model>[-N]."""
    if args.run_dir:
        path = Path(args.run_dir)
        if path.exists() and not path.is_dir():
            raise RunError(f"--run-dir {path} is a file, not a folder; choose another --run-dir")
        return RunDir(path).claim(create=not args.resume)
    if args.resume:
        runs = sorted(Path("runs").glob("*/checkpoints/latest.ckpt"), key=lambda p: p.stat().st_mtime)
        if not runs:
            raise RunError("--resume: no run with a checkpoint under runs/; pass --run-dir")
        return RunDir(runs[-1].parent.parent).claim()
    name = model_name(given.get("model") or (Path(args.init_from).stem if args.init_from else "tiny"))
    return RunDir(Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}").claim(fresh=True)


def open_run(rd, args, given):
    """(spec, config document, checkpoint or None, what --resume extended or None, the checkpoint's file
    name or None) of the run in the claimed folder rd."""
    if not args.resume:
        if rd.has_checkpoint():
            raise RunError(f"{rd.path} already holds a run; use --resume or another --run-dir")
        label = {"model": Path(args.init_from).stem} if args.init_from else {}   # the source holds the model
        return RunSpec(**{**label, **given}).resolved(), {"run_id": new_run_id()}, None, None, None
    stored, doc = rd.read_config()
    spec = stored.merge_resume(given)
    ckpt, name = resume_checkpoint(rd, doc, args.resume_from or "latest")
    if ckpt and spec.steps != stored.steps and spec.steps <= ckpt.state["step"]:
        raise RunError(f"--steps {spec.steps}: the run's {name} is at step {ckpt.state['step']} already; to train "
                       f"further, pass --steps N with N > {ckpt.state['step']}")
    extended = f"steps {stored.steps} -> {spec.steps}" if spec.steps != stored.steps else None
    return spec, doc, ckpt, extended, name


def complete_cut_short_finish(run):
    """Whether the run's last checkpoint is at its last step while its status does not say finished (a
    kill landed between the two writes that end a run: the checkpoint, then the status); if so, what
    that end did not write: the status and the log line (the run's files are whole)."""
    rd, spec, ckpt = run.rd, run.spec, run.ckpt
    status = rd.read_status()
    if not ckpt or ckpt.state.get("step", 0) < spec.steps or status.get("state") == "finished":
        return False
    state, step = ckpt.state, ckpt.state["step"]
    rd.clean_temp()                                  # an earlier kill's half-written files
    rd.write_status("finished", step=step, steps=spec.steps, updates=state.get("updates", 0), loss=status.get("loss"),
                    best_val_loss=finite(state.get("best_val_loss", math.inf)))
    rd.log(f"finished at step {step}")
    print(f"{rd.path}: its last checkpoint, at step {step} of {spec.steps}, was written before it was stopped; "
          "marked finished")
    return True


def resume_checkpoint(rd, doc, which):
    """(checkpoint, its file name) that --resume continues from (`which`: latest or best), or (None, None)
    for a run without any checkpoint (killed before its first: it starts again, nothing trained is lost).
    Without latest.ckpt the resume stops, changing nothing, unless best.ckpt is the newest checkpoint
    the run took (a kill inside the first latest.ckpt write, which comes after best's)."""
    if which == "best":
        return checkpoint_of_run(rd.best, rd, doc), BEST
    if rd.latest.is_file():
        return checkpoint_of_run(rd.latest, rd, doc), LATEST
    if not rd.latest.exists() and not rd.best.exists():
        return None, None
    if not rd.latest.exists() and rd.best.is_file():
        ckpt = checkpoint_of_run(rd.best, rd, doc)
        if all(r["step"] <= ckpt.state["step"] for r in rd.rows() if "val_loss" in r):
            return ckpt, BEST
    raise RunError(f"{rd.latest} is {'not a file' if rd.latest.exists() else 'missing'}: --resume continues from it; "
                   + ("to continue from best.ckpt instead (the run goes back to its step), pass --resume --from best"
                      if rd.best.is_file() else "the run has no best.ckpt either, so nothing to continue from"))


def checkpoint_of_run(path, rd, doc):
    """The checkpoint at path, refused unless it belongs to this run (its id and model)."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        if path == rd.latest and rd.best.is_file():
            raise CheckpointError(f"{e} (--resume --from best continues from best.ckpt)") from None
        raise
    model = doc.get("model")
    model = with_defaults(model) if isinstance(model, dict) else model        # a run from before the later fields
    if ckpt.state.get("run_id") != doc.get("run_id") or ckpt.config != model:
        raise CheckpointError(f"{path} does not belong to this run (another run's or another "
                              "model's checkpoint); remove it, or resume the run it came from")
    return ckpt


def data_and_model(spec, doc, ref, given, cache, write=True):
    """(tokenizer, tokens, mask, ModelConfig): the built-in corpus unless --data: a token file (the tokenizer
    gives the vocabulary), or text tokenized through the token cache file `cache` (written unless not
    `write`: another rank's) with --tokenizer's tokenizer, else the --init-from source's, else the one the
    cache holds (a resume), else the built-in corpus'; the mask (chat rows) says which targets count, else
    None. The model is the run's own (a resume), the --init-from source's (sources.resolve), or the spec's."""
    base = ModelConfig(**doc["model"]).validate() if "model" in doc else ref.cfg if ref else None
    if ref and "model" in given and load_config(spec.model, vocab=ref.cfg.vocab) != ref.cfg:
        raise AnectypesError(f"--init-from {spec.init_from} holds a model unlike --model {spec.model}: {ref.cfg}")
    tokenizer, mask = load_tokenizer(spec.tokenizer) if spec.tokenizer else None, None
    if ref and tokenizer:
        same_vocabulary(tokenizer, ref.tokenizer, spec.tokenizer, spec.init_from)
    if ref and ref.context and spec.seq and spec.seq > ref.context:     # positions it never learnt (docs/training.md)
        raise AnectypesError(f"--seq {spec.seq} is beyond the context --init-from {spec.init_from} was trained for "
                             f"({ref.context}, its max_position_embeddings or context_length): pass --seq "
                             f"{ref.context} or less")
    if spec.data and is_text(spec.data):
        tokenizer = (tokenizer or ref and ref.tokenizer or cache.is_file() and read_cache(cache)[2]
                     or builtin_dataset()[0])
        vocab = tokenizer.vocab_size
        seq = spec.seq or (base or load_config(spec.model, vocab=vocab)).seq    # text too short for the windows
        #                                                                           trained writes no cache
        tokens, mask = text_tokens(spec.data, tokenizer, cache, write, lambda t, m: split_data(t, seq, m))
    elif spec.data:
        vocab = tokenizer.vocab_size if tokenizer else None
        tokens = load_tokens(spec.data, vocab or (base or load_config(spec.model)).vocab)
    else:
        tokenizer, tokens = builtin_dataset()
        vocab = tokenizer.vocab_size
    cfg, lora = base or load_config(spec.model, vocab=vocab), of_spec(spec)
    cfg = replace(cfg, seq=spec.seq).validate() if spec.seq else cfg
    cfg.check_fits(spec.model, lora and check_rank(cfg, lora))
    if vocab and cfg.vocab < vocab:
        raise AnectypesError(f"the model's vocabulary ({cfg.vocab}) is smaller than the data's ({vocab})")
    if ref and vocab and not fits(tokenizer, cfg.vocab):
        raise AnectypesError(f"--init-from {spec.init_from} has a vocabulary of {cfg.vocab} tokens but the "
                             f"tokenizer has {vocab}: pass the source's own with --tokenizer (and data in it)")
    return tokenizer, tokens, mask, cfg


def split_data(tokens, seq, mask=None):
    """(train, val, train mask, val mask): the training part and the held-out last 10%, each long enough for
    one window, and with a target in it when there is a mask (None: every token is one)."""
    train, val = split(tokens)
    if len(train) < seq + 1 or len(val) < seq + 1:
        raise AnectypesError(f"data has {len(tokens)} tokens: too short for seq {seq} "
                             "(need seq+1 tokens in both the training and the 10% validation part)")
    masks = split(mask) if mask is not None else (None, None)
    if mask is not None and not (masks[0][1:].any() and masks[1][1:].any()):
        raise AnectypesError("the data's assistant messages all fall in one part: the training part and the 10% "
                             "validation part both need some (more chat rows)")
    return train, val, *masks
