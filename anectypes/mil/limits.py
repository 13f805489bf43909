"""The Neural Engine's known limits per chip, on top of Apple's op definitions (docs/ane-reference.md §3.10).

Each rule reports an `error` (reported to fail, or to give wrong results without an error) or a
`warning` (reported by one side of sources that disagree, or second-hand, or failing only for values
the program does not hold), and names its source. `check(program, chip)` lists the findings; `enforce`
is what every device's compile calls: it refuses the first error and logs each rule's warning once (but
the disputed reports every training kernel contradicts: `mil check` says them).
"""

import logging
import re
from dataclasses import dataclass

from ..errors import MILError
from .program import Var

# chip -> (the aneSubType family that names it, the dialect it reads); §1.13 (h13/h14 inferred; a base M5
# reports h16, as M4 does, so h16 gets m4's rules), §3.5
CHIPS = {"m1": ("h13", "ios16"), "m2": ("h14", "ios16"), "m3": ("h15", "ios18"), "m4": ("h16", "ios18"),
         "m5": ("h17", "ios18")}
NEWEST = {"ios16": "m2", "ios18": "m5"}          # the default chip of a dialect
M1_M2, ALL = ("m1", "m2"), tuple(CHIPS)
MIN_SURFACE_BYTES = 49152
SURFACE_ALIGN = 128                              # M5: every surface's size a multiple of this (PR#35, §1.6)
WEIGHTS_MAX = 2**31                              # BLOBFILE bytes of one program (§3.10)
WEIGHTS_MAX_MACOS27 = 2**30                      # assumed from macOS 27 until measured (eeANE v1.6.1, §3.10)
NORM_BLOB_WIDTH = 14592                          # maderix/ane-prefill-bench bfa6bb4 (§3.10)
COMPILER_WIDTH = 16384                           # the compiler's printed range (FluidInference/FluidAudio#121)


@dataclass(frozen=True)
class Finding:
    level: str            # "error" or "warning"
    rule: str
    message: str
    source: str
    line: int = None
    col: int = None
    op: str = None

    def __str__(self):
        where = (f"line {self.line}: " if self.line else "") + (f"op '{self.op}': " if self.op else "")
        return f"{self.level}: {where}{self.message} [{self.rule}; source: {self.source}]"


def family(subtype):
    """The generation number an aneSubType names: 16 for "h16", "h16g" or "H16G" (probes print suffixed
    names, §1.13), None for anything else (or None)."""
    found = re.match(r"h(\d+)", subtype or "", re.IGNORECASE)
    return int(found[1]) if found else None


def chip_of(subtype):
    """The chip (`m1`..`m5`) whose family a device's aneSubType names, or None."""
    n = family(subtype)
    return next((c for c, (s, _) in CHIPS.items() if n is not None and family(s) == n), None)


RULES = []
UNLOGGED = set()


def rule(name, level, chips, source, request=False, logged=True):
    """Register `check(function)`, which yields (operation or None, message) for each finding. A `request`
    rule is about the surfaces bound to the program: devices enforce it when a request is made (§1.9),
    so only `check` reports it. A warning not `logged` is only reported by `check` (mil check), not at
    every compile."""
    def register(check):
        RULES.append((name, level, chips, source, check, request))
        if not logged:
            UNLOGGED.add(name)
        return check
    return register


def ops_of(f, *types):
    return [o for o in f.ops if o.type in types]


def first_of(f, types, message):
    """One finding per op type: the first such op, with the count."""
    for t in types:
        found = ops_of(f, t)
        if found:
            yield found[0], message.format(op=t, n=len(found))


def arg_type(o, name):
    return o.args[name].type if name in o.args else None


def flag(o, name):
    return name in o.args and bool(o.args[name].value)


@rule("no-cast", "error", M1_M2, "maderix/ANE PR#6 (§3.5)")
def no_cast(f):
    for o in ops_of(f, "cast"):
        yield o, "M1/M2 have no cast op: declare fp16 inputs and outputs and convert on the CPU"


@rule("matmul-m1-m2", "warning", M1_M2, "[conflict] maderix/ANE PR#6 (M1 Pro) reports matmul failing on M1/M2; "
      "maderix/ANE#47 (M1) and R:benchmarks/ANE_BENCHMARK_REPORT.md (M1 Pro, M1 Max) report it running (§3.10)")
def matmul_m1_m2(f):
    yield from first_of(f, ["matmul"], "{n} matmul ops: whether M1/M2 run matmul, sources disagree")


@rule("matmul-inner-32", "error", ("m1",), "maderix/ANE#47, M1 (§3.10)")
def matmul_inner_32(f):
    for o in ops_of(f, "matmul"):
        x = arg_type(o, "x")
        k = x.shape[-2] if flag(o, "transpose_x") else x.shape[-1]
        if k % 32:
            yield o, f"inner dimension {k} is not a multiple of 32: M1 returns zeros, without an error"


@rule("sdpa-mask-ignored", "error", ALL, "R:README.md, R:training/test_ane_sdpa5.m, SUB3, ORION-C #6 (§3.6)")
def sdpa_mask_ignored(f):
    for o in ops_of(f, "scaled_dot_product_attention"):
        if "attn_mask" in o.args:
            yield o, "the ANE ignores attn_mask (unmasked attention, no error): write matmul, add(mask), softmax"


@rule("conv-wide-input", "error", ALL, "R:training/ane_classifier.h; ORION-P (§3.6)")
def conv_wide_input(f):
    for o in ops_of(f, "conv"):
        c = arg_type(o, "x").shape[1]
        if c >= 32000:
            yield o, f"conv with {c} input channels: 32,000 input channels are rejected (output channels are not " \
                     "limited so): write matmul"


@rule("conv-dynamic-grouped", "error", ("m1",), "maderix/ANE#47, M1 (§3.10)")
def conv_dynamic_grouped(f):
    for o in ops_of(f, "conv"):
        w = o.args["weight"]
        if not (w.is_const or w.from_consts) and "groups" in o.args and o.args["groups"].value > 1:
            yield o, f"conv with a computed weight and groups={o.args['groups'].value} fails on M1"


@rule("softmax-power-of-2", "warning", ALL, "[reported] Espresso's list, hollance/neural-engine#44, no details "
      "(§3.10)")
def softmax_power_of_2(f):
    for o in ops_of(f, "softmax"):
        x = arg_type(o, "x")
        n = x.shape[o.args["axis"].value if "axis" in o.args else -1]
        if n & (n - 1):
            yield o, f"softmax over {n} values, not a power of 2: reported to give InvalidMILProgram at compile"


# not logged: every training kernel ends in concat, so a compile's warning would say it in every training run
@rule("concat", "warning", ALL, "[conflict] ORION-C #1 (M4 Max) reports concat rejected; the maderix training "
      "kernels end in concat and ran on M1-M5 (R:training/training_dynamic/mil_dynamic.h, §3.6)", logged=False)
def concat(f):
    yield from first_of(f, ["concat"], "{n} concat ops: one source reports the compiler rejects concat")


@rule("m1-data-movement", "warning", ("m1",), "[conflict] maderix/ANE#47 (M1) reports reshape, transpose, concat "
      "and reduce ops failing; the maderix kernels that use them ran on M1 Pro/Max "
      "(R:benchmarks/ANE_BENCHMARK_REPORT.md, §3.10)")
def m1_data_movement(f):
    yield from first_of(f, ["reshape", "transpose", "concat", "reduce_sum"], "{n} {op} ops: reported failing on M1")


@rule("small-surface", "warning", ALL, "ORION-C #4 (§1.9)", request=True)
def small_surface(f):
    for what, vs in (("input", f.inputs), ("output", f.outputs)):
        for v in vs:
            if v.type.nbytes < MIN_SURFACE_BYTES:
                yield None, f"{what} '{v.name}' has {v.type.nbytes} bytes: its surface must be allocated at " \
                            f"least {MIN_SURFACE_BYTES} or evaluation fails with status 0x1d (device.surface does)"


@rule("mixed-surface-sizes", "warning", ALL, "ORION-C #2, #12 (§1.9)", request=True)
def mixed_surface_sizes(f):
    for what, vs in (("input", f.inputs), ("output", f.outputs)):
        if len({v.type.nbytes for v in vs}) > 1:
            yield None, f"the {what}s differ in size: bind surfaces of one allocation size or evaluation fails " \
                        "with status 0x1d (device.surfaces() does)"


@rule("m1-surface-order", "warning", ("m1",), "[conflict] maderix/ANE#47 (M1): inputs in ascending and outputs in "
      "descending size, else zeros; ORION-C #12 (M4 Max): inputs of one allocation size (§3.10)")
def m1_surface_order(f):
    for what, vs, order in (("input", f.inputs, 1), ("output", f.outputs, -1)):
        sizes = [v.type.nbytes * order for v in sorted(vs, key=lambda v: v.name)]   # bound by name (§1.9)
        if any(a >= b for a, b in zip(sizes, sizes[1:])):
            yield None, f"the {what}s by name are not in strictly {'ascending' if order > 0 else 'descending'} size"


@rule("blobfile-count", "warning", ALL, "[second-hand] ORION-P (§3.6)")
def blobfile_count(f):
    blobs = [o for o in f.ops if o.out.blob]
    if len(blobs) > 16:
        yield blobs[16], f"{len(blobs)} BLOBFILE tensors, this the 17th: at most 16 per program are reported to compile"


@rule("conv-bias", "warning", ALL, "[second-hand] ORION-P (§3.6)")
def conv_bias(f):
    for o in ops_of(f, "conv"):
        if "bias" in o.args:
            yield o, "conv is reported to have no bias on the ANE: add it after the conv"


# The extents of a tensor the engine computes: spatial (height, width; every axis but rank 4's
# channels) and channels (§3.10)
CHANNEL_MAX = 65536
EXTENT_SOURCE = ("rustane#13 (M3 Ultra: an input 16,384 wide compiles, 17,920 fails); ANEForge's measured caps, "
                 "aneforge/_targets.py and docs/cross-chip.md (M1, M2: 16,385 fails; M5: 65,536) (§3.10)")


def activations(f):
    """The tensors the engine computes or reads: the inputs and every op's result but consts, with the
    op that makes each (None for an input). Transposes, and the inputs they read, are left out: their
    extents are measured to reach millions (ANEForge)."""
    wide = {id(o.args["x"]) for o in ops_of(f, "transpose")}
    return [(None, v) for v in f.inputs if id(v) not in wide] + \
           [(o, o.out) for o in f.ops if o.type not in ("const", "transpose") and not o.out.is_const]


def extents(spatial):
    """A rule: an activation wider than `spatial` on a spatial axis, or `CHANNEL_MAX` channels."""
    def check_extents(f):
        for o, v in activations(f):
            shape = v.type.shape
            axes = [i for i in range(len(shape)) if len(shape) != 4 or i != 1]    # rank 4: [N, C, H, W]
            what = f"{'input' if o is None else 'result'} '{v.name}' {list(shape)}"
            if any(shape[i] > spatial for i in axes):
                yield o, f"{what}: {max(shape[i] for i in axes):,} along a spatial axis, more than the " \
                         f"{spatial:,} that compile"
            elif len(shape) == 4 and shape[1] > CHANNEL_MAX:
                yield o, f"{what}: {shape[1]:,} channels, more than the {CHANNEL_MAX:,} that compile"
    return check_extents


rule("extent", "error", ("m1", "m2", "m3"), EXTENT_SOURCE)(extents(16384))
rule("extent", "error", ("m4", "m5"), EXTENT_SOURCE)(extents(65536))


def widest(f):
    """The activation longest along its last axis, (op or None, var), or None."""
    return max(activations(f), key=lambda ov: ov[1].type.shape[-1], default=None)


@rule("compiler-width", "warning", ("m4", "m5"), "[conflict] the compiler prints its ranges as W <= 16,384, "
      "C <= 65,536 (FluidInference/FluidAudio#121); ANEForge measured 65,536 wide on M5 (§3.10)")
def compiler_width(f):
    o_v = widest(f)
    if o_v and COMPILER_WIDTH < o_v[1].type.shape[-1] <= 65536:
        yield o_v[0], f"'{o_v[1].name}' is {o_v[1].type.shape[-1]:,} wide: the compiler prints its range as " \
                      f"W <= {COMPILER_WIDTH:,}"


@rule("blobfile-norm-width", "warning", ALL, "[reported] maderix/ane-prefill-bench bfa6bb4: with RMSNorm weights "
      "baked in as BLOBFILE, a spatial width above 14,592 fails at evaluation with 0x1d (§3.10)")
def blobfile_norm_width(f):
    # a norm weight is a vector (one axis longer than 1); RoPE's tables and masks are not
    scaled = [o for o in ops_of(f, "mul") if any(isinstance(v, Var) and v.blob and sum(n > 1 for n in v.type.shape) <= 1
                                                 for v in o.args.values())]
    o_v = widest(f)
    if scaled and o_v and o_v[1].type.shape[-1] > NORM_BLOB_WIDTH:
        yield scaled[0], f"a mul by a BLOBFILE vector in a program {o_v[1].type.shape[-1]:,} wide: above " \
                         f"{NORM_BLOB_WIDTH:,} wide, norm weights baked in so are reported to fail with 0x1d " \
                         "(whether this tensor is a norm weight the text does not say)"


@rule("slice-width-offset", "warning", M1_M2, "[reported] ANEForge docs/numeric-cliffs.md, docs/cross-chip.md "
      "(measured on M1 and an M2 Pro, sbryngelson/ANEForge PR#145; exact on M5) (§3.10)")
def slice_width_offset(f):
    found = [o for o in ops_of(f, "slice_by_size") if o.args["begin"].value[-1] > 0]
    if found:
        yield found[0], f"{len(found)} slices begin at an offset along the last axis: values beyond ±4,094 " \
                        "there come back as ±inf on M1/M2, without an error (values are not known here)"


def blob_types(f):
    """{(path, offset): tensor type} of every BLOBFILE tensor the function reads."""
    refs = [o.out for o in f.ops] + [v for o in f.ops for v in o.args.values() if isinstance(v, Var)]
    return {(v.blob.path, v.blob.offset): v.type for v in refs if v.blob}


@rule("weights-2gib", "error", ALL, "the ANE compiler's 'Weight file size ... exceeds the maximum (2147483648 "
      "bytes)', quoted in apple/coremltools PR#2593; sbryngelson/ANEForge PR#45: ~1.5 GB compiles, ~3.4 GB "
      "fails (§3.10)")
def weights_2gib(f):
    total = sum(t.nbytes for t in blob_types(f).values())
    if total > WEIGHTS_MAX:
        yield None, f"{total:,} bytes of BLOBFILE weights, more than the {WEIGHTS_MAX:,} a program may have"


@rule("weights-1gib-macos27", "warning", ALL, "[assumed] macOS 27: eeANE v1.6.1 reports the Core ML path's "
      "model-size ceiling fell from about 2 GiB to 1 GiB, with a silent CPU fallback; unmeasured on this path "
      "(§3.10)")
def weights_1gib_macos27(f):
    total = sum(t.nbytes for t in blob_types(f).values())
    if WEIGHTS_MAX_MACOS27 < total <= WEIGHTS_MAX:
        yield None, f"{total:,} bytes of BLOBFILE weights: from macOS 27 a program is assumed to hold at most " \
                    f"{WEIGHTS_MAX_MACOS27:,} (macOS 26 and older: {WEIGHTS_MAX:,})"


@rule("m1-shared-blob", "warning", ("m1",), "[conflict] R:benchmarks/ANE_BENCHMARK_REPORT.md (M1 Pro/Max): "
      "single-blob weights and BLOBFILE offsets fail; PR#6 (M1 Pro) keeps inmem_peak's weights in one file at "
      "offsets 64 + i·(64 + C²·2) for M1/M2 (§3.10)")
def m1_shared_blob(f):
    files = {}
    for path, offset in blob_types(f):
        files.setdefault(path, []).append(offset)
    for path, offsets in files.items():
        if offsets != [64]:
            yield None, f"BLOBFILE {path} has tensors at offsets {', '.join(map(str, sorted(offsets)))}: M1 is " \
                        "reported to read one tensor per file, at offset 64"


# not logged: every training kernel takes its weights as inputs and ran on an M5 Max in the reference's form
@rule("m5-dynamic-weights", "warning", ("m5",), "[conflict] PR#35 (M5): weights passed as inputs need program(1.3) "
      "with <ios17>; the reference's dynamic kernels, program(1.3) with <ios18>, trained on an M5 Max (PR#50) "
      "(§3.10)", logged=False)
def m5_dynamic_weights(f):
    found = [o for o in ops_of(f, "matmul")
             if not any(o.args[n].is_const or o.args[n].from_consts for n in ("x", "y"))]
    if found:
        yield found[0], f"{len(found)} matmuls of two computed operands (weights as inputs): one source reports " \
                        "that M5 compiles them only in <ios17>"


@rule("m5-surface-alignment", "warning", ("m5",), "PR#35 (M5) (§1.6)", request=True)
def m5_surface_alignment(f):
    for what, vs in (("input", f.inputs), ("output", f.outputs)):
        for v in vs:
            if v.type.nbytes % SURFACE_ALIGN:
                yield None, f"{what} '{v.name}' has {v.type.nbytes} bytes: on M5 its surface must be allocated " \
                            f"a multiple of {SURFACE_ALIGN} bytes or evaluation fails (device.surface does)"


def check(program, chip=None, requests=True):
    """Every finding of the rules for `chip` (default: the newest chip of the program's dialect);
    requests=False leaves out the rules that devices enforce on requests."""
    chip = chip or NEWEST[program.dialect.name]
    if chip not in CHIPS:
        raise MILError(f"unknown chip {chip!r}; choose one of {', '.join(CHIPS)}")
    found = []
    if CHIPS[chip][1] != program.dialect.name:
        found.append(Finding("error", "dialect", f"{chip} reads the {CHIPS[chip][1]} dialect, the program is written "
                                                 f"in {program.dialect.name}", "maderix/ANE PR#6 (§3.5)"))
    for name, level, chips, source, check_rule, request in RULES:
        if chip in chips and (requests or not request):
            for f in program.functions.values():
                for o, message in check_rule(f):
                    found.append(Finding(level, name, message, source, *(o and (o.line, o.col, o.type) or ())))
    return sorted(found, key=lambda x: (x.level != "error", x.line or 0))


WARNED = set()
log = logging.getLogger(__name__)


def enforce(program, chip=None):
    """What a device's compile does: refuse the first error, log each rule's warning once per chip (but
    the UNLOGGED ones)."""
    findings = check(program, chip, requests=False)
    errors = [x for x in findings if x.level == "error"]
    if errors:
        e = errors[0]
        more = f" (and {len(errors) - 1} more: python -m anectypes.mil check --chip)" if len(errors) > 1 else ""
        raise MILError(f"{e.message} on {chip or NEWEST[program.dialect.name]} [{e.rule}; source: {e.source}]{more}",
                       e.line, e.col, e.op)
    for x in findings:
        if x.rule not in UNLOGGED and (x.rule, chip) not in WARNED:
            WARNED.add((x.rule, chip))
            log.warning("%s", x)
    return findings
