"""python -m anectypes.mil — check and run hand-written MIL, and print the table of its ops.

  check FILE.mil [--chip m1..m5]      parse, check against Apple's op definitions and the chip's known
                                      limits (default: the dialect's newest chip), print the signature
  run FILE.mil --input x=x.npy ... --out DIR [--precision fp16|fp32] [--backend sim]
  ops                                 print the op table of docs/mil.md (markdown), made from the registry

BLOBFILE paths `@model_path/weights/X.bin` resolve against --model-path (default: the folder of
FILE.mil), the layout the ANE compiler itself reads (docs/ane-reference.md §1.5).
"""

import inspect
import logging
import re
import sys
import time
from pathlib import Path

import numpy as np

from ..cli import ArgumentParser, at_least, quiet_on_closed_stdout
from ..host.files import atomic_write
from ..device import BACKENDS, open_device
from ..device.protocol import surfaces
from ..errors import AnectypesError
from . import limits
from .ops import OPS
from .parser import parse
from .types import DIALECTS, OPSETS, shorten

MODEL_PATH = "@model_path/"


class FlagError(AnectypesError):
    """A flag's value, not FILE.mil, is wrong: said without FILE.mil's name in front."""


def load_weights(program, model_path):
    """The weights mapping for every BLOBFILE the program references, read from model_path."""
    weights = {}
    for path in program.blob_paths():
        if not path.startswith(MODEL_PATH):
            raise AnectypesError(f"BLOBFILE path {shorten(path)!r} must start with {MODEL_PATH}")
        file = Path(model_path) / path[len(MODEL_PATH):]
        if not file.is_file():
            raise AnectypesError(f"BLOBFILE {shorten(path)} not found: expected {shorten(file)} (set --model-path)")
        weights[path] = file.read_bytes()
    return weights


def signature(program):
    f = program.main
    ins = ", ".join(f"{v.name}: {v.type}" for v in f.inputs)
    outs = ", ".join(f"{v.name}: {v.type}" for v in f.outputs)
    return f"main<{program.dialect.name}>({ins}) -> ({outs})"


def cmd_check(args):
    text = Path(args.file).read_bytes()            # parse() decodes UTF-8 and reports bad bytes by line
    program = parse(text)
    weights = load_weights(program, args.model_path or Path(args.file).parent)
    chip = args.chip or limits.NEWEST[program.dialect.name]
    findings = limits.check(program, chip)
    for x in findings:                             # `error: FILE: line N: op 'matmul': ... [rule; source: ...]`
        print(str(x).replace(": ", f": {args.file}: ", 1), file=sys.stderr)
    if any(x.level == "error" for x in findings):
        return 1
    logging.getLogger(limits.__name__).setLevel(logging.ERROR)           # its warnings are printed above
    open_device("sim", precision="fp32", chip=chip).compile(text, weights)   # also validates every BLOBFILE chunk
    counts = {}
    for o in program.main.ops:
        counts[o.type] = counts.get(o.type, 0) + 1
    print(signature(program))
    print(f"program({program.version}), {len(program.main.ops)} ops: "
          + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    for path, blob in weights.items():
        print(f"weights: {path} ({len(blob)} bytes)")
    print(f"chip {chip}: {len(findings)} warnings")


def load_input(spec):
    """(name, array) of one --input NAME=FILE.npy: a .npy file of numbers, never a pickle."""
    name, sep, file = spec.partition("=")
    if not sep:
        raise FlagError(f"--input takes NAME=FILE.npy, got {shorten(spec)!r}")
    try:
        with open(file, "rb") as f:
            value = np.lib.format.read_array(f, allow_pickle=False)
    except (OSError, ValueError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else e
        raise FlagError(f"--input {shorten(spec)}: not a readable .npy file ({reason})") from None
    if value.dtype.kind not in "biuf":
        raise FlagError(f"--input {shorten(spec)}: holds {value.dtype} values; the program's inputs take numbers")
    return name, value


def cmd_run(args):
    text = Path(args.file).read_bytes()            # parse() decodes UTF-8 and reports bad bytes by line
    program = parse(text)
    weights = load_weights(program, args.model_path or Path(args.file).parent)
    names, given = [v.name for v in program.main.inputs], {}
    for spec in args.input:
        name, value = load_input(spec)
        if name not in names:
            raise FlagError(f"--input {shorten(spec)}: the program has no input named {shorten(name)!r}; its "
                            f"inputs: {', '.join(map(shorten, names))}")
        if name in given:
            raise FlagError(f"--input {shorten(name)} is given twice")
        given[name] = value
    dev = open_device(args.backend, precision=args.precision)
    kernel = dev.compile(text, weights, name=Path(args.file).name)
    rng = np.random.default_rng(args.seed)
    inputs = surfaces(dev, kernel.inputs, kernel.sizes)
    for name, ttype in kernel.inputs.items():
        if name not in given and not args.random:
            raise AnectypesError(f"input '{shorten(name)}' ({ttype}) not given: pass --input {shorten(name)}=FILE.npy "
                                 "or --random")
        value = given[name] if name in given else rng.standard_normal(ttype.shape)
        if tuple(value.shape) != ttype.shape:
            raise AnectypesError(f"input '{shorten(name)}' has shape {list(value.shape)}, the program declares "
                                 f"{list(ttype.shape)}")
        inputs[name].write(value)
    outputs = surfaces(dev, kernel.outputs, kernel.sizes)
    request = dev.request(kernel, inputs, outputs)
    t0 = time.perf_counter()
    dev.eval(request)
    ms = (time.perf_counter() - t0) * 1e3
    out, values = Path(args.out), {name: surf.read() for name, surf in outputs.items()}
    try:
        for name, value in values.items():
            atomic_write(out / f"{name}.npy", lambda f: np.lib.format.write_array(f, value))
    except OSError as e:
        where = f"{e.filename}: " if e.filename else ""          # a full disk names no file
        raise FlagError(f"--out {args.out}: {where}{e.strerror or e}") from None
    for name, value in values.items():
        a = value.astype(np.float64)
        print(f"{name}: {list(a.shape)} {value.dtype} min {a.min():.6g} max {a.max():.6g} "
              f"-> {out / (name + '.npy')}")
    request.free()
    for surf in [*inputs.values(), *outputs.values()]:
        surf.free()
    kernel.free()
    label = "simulator" if dev.name == "sim" else dev.name
    print(f"eval {ms:.3f} ms ({label}, {args.precision})")


def doc_sections(text):
    """A docstring laid out as an op's in ops.py: {"": its first paragraph, "Inputs": {name: text},
    "Output": text, ...}, each text on one line."""
    summary, _, body = inspect.cleandoc(text).partition("\n\n")
    parts = re.split(r"^([A-Z][\w ]*):", body, flags=re.M)                 # a section starts at the margin
    doc = dict(zip(["", *parts[1::2]], [summary, *parts[2::2]]))
    inputs = re.split(r"^ {4}(\w+):", doc.pop("Inputs", ""), flags=re.M)   # an argument, indented once
    doc = {key: " ".join(value.split()) for key, value in doc.items()}
    if len(inputs) > 1:
        doc["Inputs"] = {name: " ".join(value.split()) for name, value in zip(inputs[1::2], inputs[2::2])}
    return doc


def op_doc(op):
    """The sections of an op's docstring, those its class does not give from its base class (add, sub
    and mul: Binary's)."""
    doc = {}
    for cls in reversed(type(op).__mro__):
        if vars(cls).get("__doc__"):
            doc.update(doc_sections(cls.__doc__))
    return doc


def op_table():
    """docs/mil.md's table of the ops, from the registry: the ops and their arguments in order, their
    opsets and dialects (Op.since, Param.newer), and from their docstrings what they compute, each
    argument, the output and what anectypes does not support of Apple's definition."""
    head = ["Op", "Computes", "Inputs", "Output", "Opsets", "Not supported by anectypes"]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for name, op in OPS.items():
        doc = op_doc(op)
        dialects = [d for d in OPSETS[OPSETS.index(op.since):] if d in DIALECTS]
        opsets = [f"iOS{op.since[3:]} on: {', '.join(dialects)}"] + [
            f"`{n}` of {', '.join(later)}: iOS17 on: ios18" for n, p in op.params.items()
            if (later := [d for d in p.newer if d in p.dtypes])]
        cells = [f"`{name}`", doc[""], "<br>".join(f"`{n}`: {doc['Inputs'][n]}" for n in op.params),
                 doc["Output"] + (f" T: {doc['T']}" if "T" in doc else ""), "; ".join(opsets),
                 doc.get("Not supported by anectypes", "")]
        cells = [re.sub(r"tensor<[^<>]*>", r"`\g<0>`", c).replace("|", "\\|") for c in cells]  # <T> is no tag
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def cmd_ops(args):
    print(op_table())


@quiet_on_closed_stdout
def main(argv=None):
    ap = ArgumentParser(prog="python -m anectypes.mil", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="parse and type-check a MIL file, print its signature")
    check.add_argument("file")
    check.add_argument("--model-path", help="folder that @model_path/ refers to (default: the file's folder)")
    check.add_argument("--chip", choices=list(limits.CHIPS),
                       help="check the known limits of this chip (default: the newest that reads the dialect)")
    run = sub.add_parser("run", help="evaluate a MIL file and save its outputs as .npy")
    run.add_argument("file")
    run.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    run.add_argument("--random", action="store_true", help="fill inputs not given with N(0,1) values")
    run.add_argument("--seed", type=at_least(0), default=0, help="seed for --random")
    run.add_argument("--out", required=True, help="folder for NAME.npy outputs")
    run.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    run.add_argument("--backend", choices=BACKENDS, default="sim")
    run.add_argument("--model-path", help="folder that @model_path/ refers to (default: the file's folder)")
    sub.add_parser("ops", help="print the op table (markdown): each op's inputs, output and opsets, and what "
                   "anectypes does not support of Apple's definition")
    args = ap.parse_args(argv)
    try:
        return {"check": cmd_check, "run": cmd_run, "ops": cmd_ops}[args.command](args) or 0
    except BrokenPipeError:                      # stdout's reader went away: quiet_on_closed_stdout's case
        raise
    except FlagError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (AnectypesError, OSError, ValueError) as e:
        print(f"error: {args.file}: {e}", file=sys.stderr)
        return 1
    except MemoryError as e:                     # numpy says what it could not allocate
        print(f"error: {args.file}: out of memory" + (f": {e}" if str(e) else ""), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
