"""The chip catalogue (mil/limits.py, docs/ane-reference.md §3.10) over the ten training kernels.

The trainer calls `check_training` before it compiles: on a chip where the catalogue refuses a kernel
it says why at once, and on M1/M2 it says that the dynamic-weight kernels need matmul and which chips
run them. `python tools/chip_table.py` prints docs/mil.md's table of every preset on every chip.
"""

import sys
from dataclasses import replace

from ..errors import AnectypesError
from ..mil import limits, parse
from .kernels import KERNELS

MATMUL_CHIPS = "M3, M4 and M5"      # chips with no report against matmul (§3.10)
WHY = ("the dynamic-weight kernels compute every projection and the attention with matmul, their weights "
       "arriving as inputs (docs/ane-reference.md §3.4); maderix/ANE PR#6 reports matmul failing on M1/M2, "
       "maderix/ANE#47 reports it running on M1 when its inner dimension is a multiple of 32 (§3.10)")


def kernel_findings(cfg, chip, lora=None):
    """{kernel: findings} for the ten kernels of `cfg` (with `lora`'s adapters) in the chip's dialect; the
    surface rules are left out, as the devices' surfaces meet them (§1.6, §1.9)."""
    dialect = limits.CHIPS[chip][1]
    return {name: limits.check(parse(make(cfg, dialect, "fp16", lora).text), chip, requests=False)
            for name, make in KERNELS.items()}


def by_rule(found, level):
    """{rule: ([kernel, ...], its first finding)} for the findings of `level`, in the catalogue's order."""
    hits = {}
    for name, findings in found.items():
        for x in findings:
            if x.level == level:
                kernels, _ = hits.setdefault(x.rule, ([], x))
                if name not in kernels:
                    kernels.append(name)
    order = [r[0] for r in limits.RULES]
    return dict(sorted(hits.items(), key=lambda kv: order.index(kv[0])))


def summary(found, level, kernels=True):
    """`rule (kernel, kernel)` (or just `rule`) for each rule of `level`, in the catalogue's order."""
    return [f"{rule} ({', '.join(names)})" if kernels else rule for rule, (names, _) in by_rule(found, level).items()]


def lora_rank(cfg, chip, lora, errors):
    """What to say of a LoRA rank that M1's matmul rule refuses: the adapter's products multiply over the
    rank (KernelBuilder.low_rank), so a rank that is a multiple of 32 holds where the model does without LoRA."""
    if not (lora and "matmul-inner-32" in errors and lora.rank % 32):
        return ""
    fits = [r for r in (lora.rank // 32 * 32, -(-lora.rank // 32) * 32) if r and
            "matmul-inner-32" not in by_rule(kernel_findings(cfg, chip, replace(lora, rank=r)), "error")]
    works = f": --lora {' or --lora '.join(map(str, fits))} holds" if fits else \
        ", and this model's own matmuls are refused there too"
    return f" --lora {lora.rank}: on {chip} a LoRA rank must be a multiple of 32{works}."


def check_training(cfg, device, lora=None):
    """Refuse a model the catalogue refuses on the device's chip, saying why and on which chips it
    refuses none of the kernels; on M1/M2 say what training there rests on."""
    if device.name == "ane" and cfg.seq % 32:
        # the kernels' outputs are [1, C, 1, seq]: only a multiple of 32 fp16 values per row is laid out alike
        # packed and engine-padded (docs/ane-reference.md §1.6)
        raise AnectypesError(f"seq {cfg.seq}: on the ANE the sequence length must be a multiple of 32 (its rows are "
                             f"padded otherwise, docs/ane-backend.md); choose {cfg.seq // 32 * 32 or 32} or "
                             f"{-(-cfg.seq // 32) * 32}")
    chip = device.catalogue_chip or limits.NEWEST[device.dialect]
    errors = by_rule(kernel_findings(cfg, chip, lora), "error")
    if errors:
        why = "; ".join(f"{rule} ({', '.join(names)}): {x.message} [source: {x.source}]"
                        for rule, (names, x) in errors.items())
        fine = [c.upper() for c in limits.CHIPS if not summary(kernel_findings(cfg, c, lora), "error")]
        also = f" On M1/M2 {WHY}." if chip in ("m1", "m2") else ""
        raise AnectypesError(f"these training kernels cannot run on {chip}: {why}.{also}{lora_rank(cfg, chip, lora, errors)} Chips where the catalogue "
                             f"refuses none of them: {', '.join(fine) or 'none'} (python -m anectypes.mil check "
                             f"--chip {chip} shows each op)")
    if chip in ("m1", "m2"):
        print(f"warning: {chip}: {WHY}; chips that run them: {MATMUL_CHIPS}", file=sys.stderr)


def table(presets, chips=tuple(limits.CHIPS)):
    """Markdown: a row per preset, a column per chip, the errors of the ten kernels (with the kernels)
    and the warnings."""
    rows = ["| Preset | " + " | ".join(chips) + " |", "|---" * (len(chips) + 1) + "|"]
    for name, cfg in presets.items():
        cells = []
        for chip in chips:
            found = kernel_findings(cfg, chip)
            errors, warnings = summary(found, "error"), summary(found, "warning", kernels=False)
            cells.append("; ".join([f"**error** {e}" for e in errors] + ([f"warnings: {', '.join(warnings)}"]
                                                                          if warnings else [])) or "none")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
