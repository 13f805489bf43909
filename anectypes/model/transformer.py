"""Forward and backward of a Llama-style transformer: ten MIL kernels on the device, the rest on the CPU.

Dataflow per step follows docs/ane-reference.md §4.3–4.4, except that activations and gradients pass
from kernel to kernel in their surfaces: a request binds the surfaces its kernel reads (its `reads`,
declared in kernels.wiring), and RMSNorm, the residuals and the SiLU-gate backward run in the
kernels. The CPU writes only the embedding and the loss's gradient, computes the classifier and the
loss, and accumulates the weight gradients with `cblas_sgemm` (beta=1) from channel-first [C, S]
views or copies of the surfaces, on a worker thread while the device evaluates the next kernels.
Each kernel compiles once and has a request per layer; a forward kernel has its own input surfaces per
layer, where the layer's weights are staged (STAGING) and the backward kernels read them. Outputs saved for
the backward have a surface per layer (OWN_OUTPUT); other outputs share one.
"""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..host import accelerate, blas
from ..host.chunks import UPDATE_CHUNK, chunks, in_lanes
from ..host.fp16 import fp16_to_fp32, to_fp16
from ..host.system import return_freed_memory
from ..mil.ops import sum_last
from ..device import open_device
from ..device.protocol import allocation
from ..errors import AnectypesError
from .kernels import KERNELS
from .lora import PARTS as LORA_PARTS, is_adapter
from .loss import IGNORE, cross_entropy_, logit_bound, scatter_add
from .ranges import Scales, choose, needs_choosing, observe


# weight -> where it is staged: (kernel, segment, transposed). The forward kernels hold each weight, as Wᵀ (§4.2)
# but for W2; the backward kernels read them there
STAGING = {"wq": ("sdpaFwd", "wq", True), "wk": ("sdpaFwd", "wk", True), "wv": ("sdpaFwd", "wv", True),
           "wo": ("woFwd", "w", True), "w1": ("ffnFused", "w1", True), "w3": ("ffnFused", "w3", True),
           "w2": ("ffnFused", "w2", False), "rms_att": ("sdpaFwd", "rms", False), "rms_ffn": ("ffnFused", "rms", False),
           # QK-norm's weights: the first head_dim channels of a column
           "q_norm": ("sdpaFwd", "qn", False), "k_norm": ("sdpaFwd", "kn", False)}
# norm -> where its fp16 scale ρ and √ε times its input's scale are staged (model/ranges.py)
NORM_SCALES = {"att": ("sdpaFwd", "rms_scale"), "ffn": ("ffnFused", "rms_scale"), "qn": ("sdpaFwd", "qn_scale"),
               "kn": ("sdpaFwd", "kn_scale")}


# outputs saved for the backward: one output surface per layer, read in place where they are float32
# (other kernels' outputs are consumed within the layer: one output surface shared by all layers)
OWN_OUTPUT = ("sdpaFwd", "ffnFused")
# step-time breakdown (ms): kernel evaluation, surface writes/reads incl. fp16 conversion, the
# classifier's two sgemms, dW (the sgemms when computed inline, else the wait for the worker);
# "total" is the whole forward_backward, whose rest is CPU work (the final norm, the loss, the embedding)
TIMES = ("eval", "io", "cls", "dw_wait", "total")
PARTS = ("eval", "io", "cls", "dw_wait", "cpu")


def step_parts(times):
    """A step's time (ms) by part: the measured ones, and "cpu", what remains of its total."""
    parts = {k: times[k] for k in PARTS[:-1]}
    parts["cpu"] = max(0.0, times["total"] - sum(parts.values()))
    return parts


def allocations(kernels, compiled):
    """Bytes to allocate surfaces with, by (kernel, input) for a kernel's own inputs and (kernel,
    "out") for its outputs (and `top`, `bottom`): at least what the engine touches of each (Kernel.sizes,
    for every kernel that binds it); one request's inputs share one allocation size (§1.9), so the
    surfaces a kernel reads all take the largest one's."""
    need = lambda n, names: max((compiled[n].sizes.get(x, 0) for x in names), default=0)
    alloc = {(n, "out"): allocation(k.out_shape, 2, need(n, compiled[n].outputs)) for n, k in kernels.items()}
    alloc.update({(n, x): allocation(k.in_shapes[x], 2, need(n, [x])) for n, k in kernels.items() for x in k.own})
    source = lambda src, which: (src, which if which in kernels[src].own else "out")
    for n, k in kernels.items():           # a surface read in place: as large as its reader needs too
        for x, (src, which) in k.reads.items():
            alloc[source(src, which)] = max(alloc[source(src, which)], allocation(k.in_shapes[x], 2, need(n, [x])))
    groups = [[source(src, which) for src, which in k.reads.values()] + [(n, x) for x in k.own]
              for n, k in kernels.items()]
    for _ in groups:                           # a surface may be in several groups: settle
        for group in groups:
            alloc.update(dict.fromkeys(group, max(alloc[m] for m in group)))
    return alloc


def float32(view, copy):
    """A surface view as float32: exact bit-level conversion from fp16, or the view/a copy of fp32."""
    if view.dtype == np.float32:
        return np.array(view) if copy else view
    out = np.empty(view.shape, np.float32)
    fp16_to_fp32(view, out)
    return out


def rmsnorm(x, w, eps):
    """Channel-first RMSNorm over axis 0; returns (y, 1/rms per position)."""
    inv = 1.0 / np.sqrt(np.einsum("cs,cs->s", x, x) / x.shape[0] + eps)
    y = x * inv
    y *= w[:, None]
    return y, inv


def rmsnorm_backward(x, inv, w, dy):
    """(dx, dw) of y = x·inv·w with inv = 1/√(mean x² + eps)."""
    xhat = x * inv
    dw = np.einsum("cs,cs->c", dy, xhat)
    dxhat = dy * w[:, None]
    proj = np.einsum("cs,cs->s", dxhat, xhat) / x.shape[0]
    xhat *= proj
    dxhat -= xhat
    dxhat *= inv
    return dxhat, dw


class Transformer:
    """Parameters, staged surfaces and the per-step forward/backward on one device."""

    def __init__(self, cfg, device, params, active, exact=False, lora=None):
        self.cfg, self.dev, self.params, self.lora = cfg, device, params, lora
        # with LoRA (a model.lora.Lora; params hold the adapters too) only the adapters train: the base
        # weights are staged once, have no gradients and no optimizer state
        self.trainable = {k: v for k, v in params.items() if not lora or is_adapter(k)}
        self.active = np.asarray(active, np.int64)             # compact vocabulary (§4.7)
        self.compact_of = np.full(cfg.vocab, -1, np.int64)
        self.compact_of[self.active] = np.arange(len(self.active))
        # with every id active the compact table is the embedding itself: no copies, no scatter
        self.full_vocab = len(self.active) == cfg.vocab
        self.cls = "embed" if cfg.tied else "classifier"        # the classifier's parameter
        # the gradients are views of one flat buffer: one Allreduce sums them over MPI ranks
        self.grad_buffer, self.grads = flat_zeros(self.trainable)
        # exact: each micro-step's gradients move into a float64 sum (bank), the buffer summed instead
        self.exact = np.zeros(self.grad_buffer.size, np.float64) if exact else None
        self.compact_grad = (np.zeros((0, cfg.dim), np.float32) if lora else self.grads[self.cls] if self.full_vocab
                             else np.zeros((len(self.active), cfg.dim), np.float32))   # folded in by wait()
        self.logits_buf = np.empty((len(self.active), cfg.seq), np.float32)
        dtype = "fp32" if device.precision == "fp32" else "fp16"
        self.kernels = {n: make(cfg, device.dialect, dtype, lora) for n, make in KERNELS.items()}
        self.compiled = {n: device.compile(k.text, k.weights, name=n) for n, k in self.kernels.items()}
        alloc = allocations(self.kernels, self.compiled)
        self.out = {n: [device.surface(k.out_shape, alloc=alloc[n, "out"])
                        for _ in (range(cfg.layers) if n in OWN_OUTPUT else [0])] for n, k in self.kernels.items()}
        self.inp = {n: [{x: device.surface(k.in_shapes[x], alloc=alloc[n, x]) for x in k.own} for _ in range(cfg.layers)]
                    for n, k in self.kernels.items()}            # per layer, the own inputs by name
        self.top = device.surface(self.kernels["qBwd"].out_shape, alloc=alloc["qBwd", "out"])
        self.bottom = device.surface(self.kernels["ffnFused"].out_shape, alloc=alloc["ffnFused", "out"])
        self.req = {n: [device.request(self.compiled[n], self.inputs(n, i), {self.output_name(n): self.out_surface(n, i)})
                        for i in range(cfg.layers)] for n in self.kernels}
        # dW overlaps kernel evaluation when the kernels run elsewhere (the ANE); the simulator's
        # kernels use the same cores, where overlapping only oversubscribes them (docs/train-speed.md)
        self.dw = None if device.shares_cpu else ThreadPoolExecutor(1, thread_name_prefix="anectypes-dw")
        self.lanes = min(4, os.cpu_count() or 1)
        self.cpu = ThreadPoolExecutor(self.lanes, thread_name_prefix="anectypes-cpu")   # the loss, the update
        self.pending = []
        self.saved_nbytes = 0         # set by forward()
        self.reset_times()
        self.in_surfaces = set()      # the frozen weights whose arrays are views of the surfaces (see stage_weights)
        # fp16 (the ANE's arithmetic): the kernels compute at the scales of model/ranges.py, chosen at the first
        # forward from a float32 run and then from what each forward shows (`seen`, until adapt_scales)
        self.scales, self.guarded = Scales.ones(cfg), device.precision != "fp32"
        self.calibrated, self.seen, self.notes = not self.guarded, None, []
        self.stage_weights()

    def output_name(self, n):
        return next(iter(self.compiled[n].outputs))

    def inputs(self, kernel, layer):
        """What a kernel's request for `layer` binds: its own input surfaces (the attention-backward
        kernels have none) and the surfaces it reads in place (its `reads`)."""
        return {**self.inp[kernel][layer],
                **{name: self.source(k, which, layer) for name, (k, which) in self.kernels[kernel].reads.items()}}

    def source(self, kernel, which, layer):
        """The surface a kernel's `reads` entry (kernel, which) names for `layer` (see kernels.Wiring)."""
        if which in self.inp[kernel][layer]:
            return self.inp[kernel][layer][which]
        if which == "above":
            return self.top if layer + 1 == self.cfg.layers else self.out_surface(kernel, layer + 1)
        if which == "below":
            return self.bottom if layer == 0 else self.out_surface(kernel, layer - 1)
        return self.out_surface(kernel, layer)

    def stage_weights(self):
        """Write every layer's weights into its kernels' input surfaces (an update re-stages each weight
        as AdamW.step updates it, through stage(), then refresh_embedding() follows). With LoRA, where the
        surfaces store float32 exactly (the simulator in fp32 mode), each frozen layer matrix, once staged, is
        replaced in `params` (the caller's dict: its own array goes) by a view of its surface (never re-staged:
        nothing changes it), so the model holds it once, and at most one more weight at a time while staging."""
        for name in self.params:
            self.stage(name)
            if self.lora and (view := self.staged_view(name)) is not None:
                self.params[name] = view
                self.in_surfaces.add(name)
                return_freed_memory()      # the array it replaced lies freed among others: hand it back now
        for layer in range(self.cfg.layers):
            self.stage_scales(layer)
        self.refresh_embedding()

    def stage_scales(self, layer):
        """Write a layer's norm scales ρ and √ε times their input's scale (model/ranges.py) into the two columns beside
        each norm's weight."""
        for norm, rhos in self.scales.norms.items():
            rho, (kernel, segment) = rhos[layer], NORM_SCALES[norm]
            k = self.kernels[kernel]
            root_eps = np.sqrt(self.cfg.norm_eps) * self.scales.input_scale(norm, layer)
            self.own_surface(kernel, segment, layer).write(
                np.tile(np.float32([rho, root_eps]), (k.in_shapes[k.input_of(segment)][1], 1)), k.index(segment))

    def set_scales(self, scales):
        """Take new scales: restage the weights whose factor changed and every layer's norm scales."""
        old, self.scales = self.scales, scales
        for name in self.params:
            layer, weight, part = layer_weight(name)
            if weight and part != "lora_a" and old.weight_factor(weight, layer) != scales.weight_factor(weight, layer):
                self.stage(name)
        for layer in range(self.cfg.layers):
            self.stage_scales(layer)

    def calibrate(self, tokens):
        """Choose the scales from a float32 forward of the same kernels on `tokens` (the simulator's fp32 mode)."""
        with Transformer(self.cfg, open_device("sim", precision="fp32"), dict(self.params), self.active,
                         lora=self.lora) as ref:
            ref.forward(tokens)
            self.restore_scales(choose(observe(ref), self.cfg))

    def restore_scales(self, scales):
        """Take chosen scales, or those a checkpoint saved (so a resumed run computes as the run it continues)."""
        self.set_scales(scales)
        self.calibrated = True

    def adapt_scales(self, combine=None):
        """At an update: choose the scales again if what the forwards since the last showed lies outside their band
        (ranges.needs_choosing). `combine` maxima over ranks (an array, in place), so all ranks choose alike.
        Returns a note for the run's log, or None."""
        seen, self.seen = self.seen, None
        if seen is None:
            return None
        if combine:
            a = seen.as_array()
            combine(a)
            seen = seen.from_array(a)
        if not needs_choosing(self.scales, seen, self.cfg):
            return None
        self.set_scales(choose(seen, self.cfg))
        return f"fp16 scales chosen again from this update's ranges: {self.scales.describe()}"

    def staged_view(self, name):
        """A frozen layer matrix as a view of the surface that holds it, if that memory stores float32 exactly."""
        layer, weight, part = layer_weight(name)
        value = self.params[name]
        if part or value.ndim != 2 or weight not in STAGING or self.scales.weight_factor(weight, layer) != 1:
            return None
        kernel, segment, transposed = STAGING[weight]
        surface = self.own_surface(kernel, segment, layer)
        if surface.handle is not None or surface.convert is not None or surface.array.dtype != np.float32:
            return None
        block = surface.array[self.kernels[kernel].index(segment)]
        return (block.T if transposed else block)[:value.shape[0], :value.shape[1]]

    def stage(self, name):
        """Write a weight into the input surface that holds it (a norm weight as a column)."""
        layer, weight, part = layer_weight(name)
        if weight not in STAGING:
            return
        kernel, segment, transposed = STAGING[weight]
        factor = self.scales.weight_factor(weight, layer)      # the stream's or a projection's fp16 scale
        if part:                     # an adapter: small, Aᵀ (segment _1) or B (_2) [rows, rank] written chunk by chunk
            first = part == "lora_a"
            value, segment = self.params[name], f"{segment}_{1 if first else 2}"
            value = np.ascontiguousarray(value.T) if first else value * np.float32(factor)
            surface = self.own_surface(kernel, segment, layer)
            for lo, n, index in self.kernels[kernel].chunks(segment, len(value)):
                surface.write(value[lo:lo + n], index)
            return
        value = self.params[name]
        value = value.reshape(-1, 1) if value.ndim == 1 else value
        if factor != 1:                # a power of two: exact (a copy, one weight at a time)
            value = value * np.float32(factor)
        # in bands of 128 rows (a whole transposed copy misses the cache; docs/train-speed.md has the band sizes
        # measured), the transposed ones by accelerate.transpose (vDSP_mtrans, or OpenBLAS's transposing copy:
        # faster than numpy's). Float32 memory (the simulator's) takes each band rounded as the surfaces store it;
        # fp16 memory (the ANE's) takes it converted (vImage fills a strided block in one call), transposed in
        # float32 first. The bands are dealt to the lanes in turn, and the main thread holds the surface's lock
        # meanwhile
        bands = [slice(r, min(r + 128, len(value))) for r in range(0, len(value), 128)]
        surface = self.own_surface(kernel, segment, layer)
        half = surface.array.dtype == np.float16
        with surface.writing() as a:
            block = a[self.kernels[kernel].index(segment)]

            def copy(_, bands):
                for b in bands:
                    w = value[b] if half else surface.stored(value[b])
                    if half:
                        to_fp16(accelerate.transpose(w, np.empty(w.shape[::-1], np.float32)) if transposed else w,
                                block[:w.shape[1], b] if transposed else block[b])
                    elif transposed:
                        accelerate.transpose(w, block[:w.shape[1], b])
                    else:
                        block[b] = w
            in_lanes(copy, bands, self.lanes, self.cpu.map)

    def complete_grads(self):
        """The gradients an update takes (train.optim.update_model), complete: see wait(); with exact
        accumulation, the float64 sum moved into them (and zeroed)."""
        self.wait()
        if self.exact is not None:
            self.move(lambda g, e: (np.copyto(g, e, casting="same_kind"), e.fill(0)))
        return self.grads

    def refresh_embedding(self):
        """What the CPU derives from the classifier (the embedding, tied) after it changes."""
        cls = self.params[self.cls]
        self.compact_embed = cls if self.full_vocab else cls[self.active]
        self.embed_norm = float(np.sqrt(np.einsum("vd,vd->v", self.compact_embed, self.compact_embed).max()))
        self.embed_max = float(np.abs(self.params["embed"]).max())    # the stream's start, for ranges.observe

    def own_surface(self, kernel, segment, layer):
        """The own input surface of a kernel, for `layer`, that holds a weight segment."""
        return self.inp[kernel][layer][self.kernels[kernel].input_of(segment)]

    # -- device helpers (each timed into self.times, ms, for the step breakdown)
    def timed(self, what, fn, *args, **kw):
        t0 = time.perf_counter()
        result = fn(*args, **kw)
        self.times[what] += (time.perf_counter() - t0) * 1e3
        return result

    def out_surface(self, kernel, layer=0):
        """The output surface a kernel's evaluation for `layer` writes."""
        return self.out[kernel][layer if kernel in OWN_OUTPUT else 0]

    def eval(self, kernel, layer):
        self.timed("eval", self.dev.eval, self.req[kernel][layer])

    def read(self, kernel, surface, *names):
        """Named output segments of a kernel's output surface as float32 arrays: views where the
        surface is float32 (the simulator), valid until the next evaluation writing it, which comes
        after their use; copies when a dW worker may read them later. An fp16 surface (the ANE's) is
        converted, straight from its memory under the read lock, so nothing points into it afterwards."""
        t0 = time.perf_counter()
        with surface.reading() as a:
            result = [float32(self.kernels[kernel].output(a, n), copy=self.dw is not None) for n in names]
        self.times["io"] += (time.perf_counter() - t0) * 1e3
        return result if len(result) > 1 else result[0]

    def run(self, kernel, layer, *names):
        """Evaluate, then read the named output segments (see read)."""
        self.eval(kernel, layer)
        return self.read(kernel, self.out_surface(kernel, layer), *names)

    def accumulate(self, grad, a, b=None, alpha=1.0):
        """grad += alpha·a·bᵀ with sgemm, or without b grad += a's row sums (over positions: a norm
        weight's gradient); on the worker thread when there is one (a, b referenced, not copied)."""
        args = (add_row_sums, grad, a) if b is None else (blas.sgemm, a, b, grad)
        self.work(*args, **({} if b is None else dict(trans_b=True, alpha=alpha, beta=1.0)))

    def work(self, fn, *args, **kw):
        """fn(*args, **kw), gradient work: on the worker thread when there is one (args referenced, not copied)."""
        if self.dw:
            self.pending.append(self.dw.submit(fn, *args, **kw))
        else:
            self.timed("dw_wait", fn, *args, **kw)

    def drain(self):
        """Wait for the dW worker: its inputs (saved activations, dlogits) are about to change."""
        t0 = time.perf_counter()
        for f in self.pending:
            f.result()
        self.pending = []
        self.times["dw_wait"] += (time.perf_counter() - t0) * 1e3

    def wait(self):
        """Finish all gradient work: self.grads is complete afterwards."""
        self.drain()
        if not self.full_vocab and not self.lora:
            self.grads[self.cls][self.active] += self.compact_grad
            self.compact_grad.fill(0)

    def reset_times(self):
        self.times = dict.fromkeys(TIMES, 0.0)

    # -- one sequence
    def forward(self, tokens):
        """Run the layers; returns the final hidden state [dim, S] (at the stream's scale) and what backward needs.
        In fp16, the scales are chosen at the first forward, and a forward whose tensors left fp16 is run again at
        scales chosen from a float32 forward (said in `notes`); if it is still out of range, AnectypesError."""
        if not self.calibrated:
            self.calibrate(tokens)
        x, saved = self.layers_forward(tokens)
        if self.guarded:
            seen = observe(self)
            if seen.broken:
                self.notes.append(f"fp16: {seen.broken} left fp16's range; scales chosen again from a float32 forward "
                                  "and the micro-step run again")
                self.calibrate(tokens)
                x, saved = self.layers_forward(tokens)
                seen = observe(self)
                if seen.broken:
                    raise AnectypesError(f"fp16: {seen.broken} leaves fp16's range at every scale the kernels take "
                                         f"({self.scales.describe()}); train this model with --precision fp32")
            self.seen = seen.merged(self.seen)
        return x, saved

    def layers_forward(self, tokens):
        """forward's layers, at the current scales."""
        # the embedding, where the first layer reads its input (at the stream's scale); the kernels pass all else along
        s, ffn = np.float32(self.scales.stream), self.kernels["ffnFused"]
        embed = self.params["embed"][tokens].T
        embed = embed if s == 1 else embed * s
        self.timed("io", self.bottom.write, embed, ffn.out_index("x_next"))
        # and its 1/rms, where the first layer's norm reads the last norm's (kernels.stream_norm)
        _, inv = rmsnorm(embed, np.ones(self.cfg.dim, np.float32), self.final_eps)
        self.timed("io", self.bottom.write, inv[None, :], ffn.out_index("x2n_inv"))
        saved = []
        for i in range(self.cfg.layers):
            xn, attn = self.run("sdpaFwd", i, "xn", "attn")
            self.eval("woFwd", i)
            x, x2n, gate = self.run("ffnFused", i, "x_next", "x2n", "gate")
            saved.append((xn, attn, x2n, gate))              # the inputs of the weight gradients
        # what the saved activations hold beyond the output surfaces they may be views of
        self.saved_nbytes = sum(a.nbytes for t in saved for a in t if a.base is None)
        return x, saved

    def logits(self, tokens):
        """Compact-vocabulary logits [CV, S] for a full window of tokens (forward only)."""
        self.drain()
        x, _ = self.forward(tokens)
        xf, _ = rmsnorm(x, self.params["rms_final"], self.final_eps)
        return blas.sgemm(self.compact_embed, xf)

    def forward_backward(self, tokens, targets, loss_scale=1.0):
        """Loss of one sequence; adds loss_scale × its gradients into self.grads (complete after wait()).
        Targets IGNORE count for nothing (the loss is the mean over the others)."""
        t0, p = time.perf_counter(), self.params
        self.drain()
        x, saved = self.forward(tokens)
        xf, invf = rmsnorm(x, p["rms_final"], self.final_eps)   # dy below: the gradient at the stream's scale
        g = self.timed("cls", blas.sgemm, self.compact_embed, xf, self.logits_buf)   # logits [CV, S]
        idx = np.where(targets == IGNORE, IGNORE, self.compact_of[targets])
        loss, f = cross_entropy_(g, idx, logit_bound(self.embed_norm, xf), self.cpu.map)
        f *= loss_scale                              # the loss-scaled gradient of the logits is G·diag(f)
        dxf = self.timed("cls", blas.sgemm, self.compact_embed, g, trans_a=True)
        dxf *= f
        if not self.lora:
            self.accumulate(self.compact_grad, g, xf * f)
        dy, dw = rmsnorm_backward(x, invf, p["rms_final"], dxf)
        if not self.lora:
            self.grads["rms_final"] += dw
        self.timed("io", self.top.write, dy, self.kernels["qBwd"].out_index("dy"))  # the top layer reads it
        for i in reversed(range(self.cfg.layers)):
            self.layer_backward(i, saved[i])
        self.drain()                                          # the embedding gradient may be compact_grad
        if not self.lora:
            dy = self.read("qBwd", self.out_surface("qBwd"), "dy")   # the first layer's input gradient
            s = np.float32(self.scales.stream)                        # the embedding was written times it
            scatter_add(self.grads["embed"], tokens, dy.T if s == 1 else dy.T * s)   # embedding lookup backward
        if self.exact is not None:
            self.bank()
        self.times["total"] += (time.perf_counter() - t0) * 1e3
        return loss

    def layer_backward(self, i, saved):
        """One layer's backward: the kernels pass the gradients along in their surfaces (from the
        layer above's qBwd output to this layer's); the CPU adds the weight gradients."""
        a, L = np.float32(self.cfg.alpha), f"layers.{i}."
        xn, attn, x2n, gate = saved
        self.eval("ffnBwdW2t", i)
        dy = self.read("qBwd", self.source("qBwd", "above", i), "dy")
        dh1, dh3 = self.run("ffnBwdW13t", i, "dh1", "dh3")      # the SiLU-gate backward runs there
        self.weight_grad(L + "w2", dy, gate, alpha=a)
        self.weight_grad(L + "w1", dh1, x2n)
        self.weight_grad(L + "w3", dh3, x2n)
        dx2, g_norm = self.run("wotBwd", i, "dx2", "g")           # and the FFN norm's backward
        if not self.lora:
            self.accumulate(self.grads[L + "rms_ffn"], g_norm)                   # Σ over positions
        self.weight_grad(L + "wo", dx2, attn, alpha=a)
        dv = self.run("sdpaBwd1", i, "dv")
        if self.cfg.qk_norm:                                  # and QK-norm's backward (its weights frozen with LoRA)
            dq, dk, gq, gk = self.run("sdpaBwd2", i, "dq", "dk", "gq", "gk")
            for name, gw in (("q_norm", gq), ("k_norm", gk)) if not self.lora else ():   # Σ over heads, positions
                self.accumulate(self.grads[L + name], gw.reshape(-1, self.cfg.head_dim, self.cfg.seq).sum(axis=0))
        else:
            dq, dk = self.run("sdpaBwd2", i, "dq", "dk")
        self.weight_grad(L + "wq", dq, xn)
        self.weight_grad(L + "wk", dk, xn)
        self.weight_grad(L + "wv", dv, xn)
        self.eval("kvBwd", i)
        if self.lora:
            self.eval("qBwd", i)
        else:
            self.accumulate(self.grads[L + "rms_att"], self.run("qBwd", i, "g"))  # and the attention norm's

    @property
    def final_eps(self):
        """The final norm's ε at the stream's scale (the CPU's norm of the stream as the kernels carry it)."""
        return self.cfg.norm_eps * self.scales.stream ** 2

    def weight_grad(self, name, dy, x, alpha=1.0):
        """The gradient of a projection y = W·x from its output's gradient alpha·dy: W's, alpha·dy·xᵀ; or with
        LoRA, its adapter's (none for a frozen weight without one), from the same two products. W was staged times
        its fp16 factor (model/ranges.py), so the kernels' dy is the gradient of that output: the factor is W's too."""
        layer, weight, _ = layer_weight(name)
        alpha *= self.scales.weight_factor(weight, layer)
        if not self.lora:
            self.accumulate(self.grads[name], dy, x, alpha=alpha)
        elif name + ".lora_a" in self.params:
            a, b, ga, gb = (d[f"{name}.{p}"] for d in (self.params, self.grads) for p in LORA_PARTS)
            self.work(adapter_grads, a, b, ga, gb, dy, x, alpha * self.lora.scale)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Free the device's requests, kernels (unload, temp folders) and surfaces; once."""
        if not self.compiled:
            return
        self.drain()
        if self.dw:
            self.dw.shutdown()
        self.cpu.shutdown()
        for reqs in self.req.values():
            for r in reqs:
                r.free()
        for k in self.compiled.values():
            k.free()
        for s in self.surfaces():
            s.free()
        self.req, self.compiled, self.inp, self.out = {}, {}, {}, {}

    def surfaces(self):
        own = [s for layers in self.inp.values() for surfaces in layers for s in surfaces.values()]
        return own + [s for ss in self.out.values() for s in ss] + [self.top, self.bottom]

    def zero_grads(self):
        self.drain()
        for g in [*self.grads.values(), self.compact_grad, *([] if self.exact is None else [self.exact])]:
            g.fill(0)

    @property
    def summed(self):
        """The buffer the ranks sum before an update: the gradients', or with exact, the float64 sum's."""
        return self.grad_buffer if self.exact is None else self.exact

    def bank(self):
        """Exact accumulation (--exact-accum): add this micro-step's gradients to the float64 sum and zero
        them. A sum of a few float32 numbers in float64 is exact (unless their exponents lie more than
        ~28 apart), so the update's sum does not depend on its micro-steps' order: N ranks add up to
        what one process adds, bit for bit, in both precisions."""
        self.wait()
        self.move(lambda g, e: (np.add(e, g, out=e), g.fill(0)))

    def move(self, fn):
        """fn(gradients, float64 sum) for each matching cache-sized piece of the two buffers, on the lanes."""
        pieces = list(chunks(self.grad_buffer, self.exact, size=UPDATE_CHUNK))
        in_lanes(lambda _, mine: [fn(g, e) for g, e in mine], pieces, self.lanes, self.cpu.map)


def layer_weight(name):
    """(layer, weight, adapter part or None) of a layer parameter's name, as (3, "wq", "lora_a") of
    "layers.3.wq.lora_a"; (None, None, None) for the others."""
    if not name.startswith("layers."):
        return None, None, None
    _, layer, weight, *part = name.split(".")
    return int(layer), weight, (part or [None])[0]


def flat_zeros(like, align=16):
    """(a float32 buffer of zeros, views of it shaped like each array of `like`), each view starting on a
    64-byte boundary of the buffer."""
    sizes = {k: -(-v.size // align) * align for k, v in like.items()}
    buffer, at, views = np.zeros(sum(sizes.values()), np.float32), 0, {}
    for k, v in like.items():
        views[k] = buffer[at:at + v.size].reshape(v.shape)
        at += sizes[k]
    return buffer, views


def adapter_grads(a, b, ga, gb, dy, x, scale):
    """The LoRA gradients of y = W·x + scale·B·(A·x) from dy [out, S] and x [in, S], added: gb += scale·dy·(A·x)ᵀ,
    ga += scale·(Bᵀ·dy)·xᵀ (the kernels gave dy and x; the rank-sized products are the CPU's)."""
    blas.sgemm(dy, blas.sgemm(a, x), gb, trans_b=True, alpha=scale, beta=1.0)
    blas.sgemm(blas.sgemm(b, dy, trans_a=True), x, ga, trans_b=True, alpha=scale, beta=1.0)


def add_row_sums(grad, a):
    grad += sum_last(a)[:, 0]
